"""Signed commands: enqueue signs, the agent's runner runs what verifies and refuses the rest with a reason."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from sqlalchemy import update

from collector.command_runner import CommandRunner, NonceLedger, register_handler, unregister_handler
from store.commands import claim_pending, enqueue_command, finish, get_command
from store.errors import InvalidInput, NotFound
from store.models import Command
from store.settings import Settings
from store.signing import canonical, sign, verify

SECRET = b"test-secret"


@pytest.fixture
def settings(fleet_home: Path) -> Settings:
    return Settings()


def runner_for(store, settings: Settings, host: str = "h1") -> CommandRunner:
    return CommandRunner(store, settings, host)


def enqueue(store, host="h1", kind="ping", payload=None, ttl=60.0, **kw) -> int:
    with store.session() as s:
        return enqueue_command(s, host, kind, payload or {"echo": "hi"}, ttl, secret=SECRET, **kw).id


def row(store, command_id: int) -> Command:
    with store.session() as s:
        return get_command(s, command_id)


def test_signature_covers_every_field():
    base = ("ping", "h1", {"a": 1, "b": [1, 2]}, "n1", 100.0)
    sig = sign(SECRET, *base)
    assert verify(SECRET, sig, *base)
    assert canonical(*base) == canonical("ping", "h1", {"b": [1, 2], "a": 1}, "n1", 100.0)  # key order is irrelevant
    for changed in (("stop",) + base[1:], base[:1] + ("h2",) + base[2:], base[:2] + ({"a": 2, "b": [1, 2]},) + base[3:],
                    base[:3] + ("n2", 100.0), base[:4] + (100.5,)):
        assert not verify(SECRET, sig, *changed)
    assert not verify(b"other-secret", sig, *base)
    assert not verify(SECRET, None, *base)
    with pytest.raises(ValueError):
        sign(b"", *base)


def test_ping_runs_and_is_recorded(any_store, settings):
    cid = enqueue(any_store, payload={"echo": "hello"})
    outcomes = runner_for(any_store, settings).poll()
    assert [(o.command_id, o.status) for o in outcomes] == [(cid, "done")]
    command = row(any_store, cid)
    assert command.status == "done" and command.result["pong"] is True and command.result["echo"] == "hello"
    assert command.claimed_at is not None and command.done_at is not None
    assert runner_for(any_store, settings).poll() == []  # nothing pending any more


def test_other_hosts_commands_are_not_claimed(sqlite_store, settings):
    enqueue(sqlite_store, host="h2")
    assert runner_for(sqlite_store, settings, "h1").poll() == []
    assert [o.status for o in runner_for(sqlite_store, settings, "h2").poll()] == ["done"]


def refused_reason(store, settings, cid: int) -> str:
    outcomes = runner_for(store, settings).poll()
    assert [(o.command_id, o.status) for o in outcomes] == [(cid, "refused")]
    command = row(store, cid)
    assert command.status == "refused"
    return command.result["reason"]


def test_unsigned_is_refused(sqlite_store, settings, caplog):
    ran = []
    register_handler("probe", lambda payload, ctx: ran.append(payload))
    try:
        cid = enqueue(sqlite_store, kind="probe")
        with sqlite_store.session() as s:
            s.execute(update(Command).where(Command.id == cid).values(signature=None))
        assert refused_reason(sqlite_store, settings, cid).startswith("unsigned")
        assert ran == []
        assert "refused command" in caplog.text
    finally:
        unregister_handler("probe")


@pytest.mark.parametrize(
    "change",
    [
        {"payload": {"echo": "rm -rf /"}},
        {"kind": "stop"},
        {"host_id": "h1", "nonce": "0" * 32},
        {"expires_at": time.time() + 10_000},
        {"signature": "ab" * 32},
    ],
    ids=["payload", "kind", "nonce", "expiry", "signature"],
)
def test_tampered_is_refused(any_store, settings, change):
    cid = enqueue(any_store)
    with any_store.session() as s:
        s.execute(update(Command).where(Command.id == cid).values(**change))
    assert refused_reason(any_store, settings, cid).startswith("tampered")


def test_signed_under_another_secret_is_refused(sqlite_store, settings):
    with sqlite_store.session() as s:
        cid = enqueue_command(s, "h1", "ping", {}, 60, secret=b"a-different-fleet").id
    assert refused_reason(sqlite_store, settings, cid).startswith("tampered")


def test_expired_is_refused(any_store, settings):
    cid = enqueue(any_store, ttl=5.0, now=time.time() - 60)
    assert refused_reason(any_store, settings, cid).startswith("expired")


def test_replayed_is_refused_even_after_a_restart(any_store, settings):
    ran = []
    register_handler("count", lambda payload, ctx: ran.append(ctx.command_id) or {"n": len(ran)})
    try:
        cid = enqueue(any_store, kind="count")
        assert [o.status for o in runner_for(any_store, settings).poll()] == ["done"]
        assert ran == [cid]
        # an attacker (or a buggy tool) puts the used row back in the queue
        with any_store.session() as s:
            s.execute(update(Command).where(Command.id == cid).values(status="pending"))
        assert refused_reason(any_store, settings, cid).startswith("replayed")  # a fresh runner: ledger on disk
        assert ran == [cid]
    finally:
        unregister_handler("count")


def test_unknown_kind_is_refused(sqlite_store, settings):
    cid = enqueue(sqlite_store, kind="format-disk")
    assert refused_reason(sqlite_store, settings, cid).startswith("unknown kind")


def test_handler_error_marks_failed(sqlite_store, settings):
    def boom(payload, ctx):
        raise RuntimeError("checkpoint folder missing")

    register_handler("boom", boom)
    try:
        cid = enqueue(sqlite_store, kind="boom")
        assert [o.status for o in runner_for(sqlite_store, settings).poll()] == ["failed"]
        assert "checkpoint folder missing" in row(sqlite_store, cid).result["error"]
    finally:
        unregister_handler("boom")


def test_handlers_get_their_context(sqlite_store, settings):
    seen = {}
    register_handler("ctx", lambda payload, ctx: seen.update(payload=payload, host=ctx.host_id, action=ctx.action_id))
    try:
        enqueue(sqlite_store, kind="ctx", payload={"step": 7})
        runner_for(sqlite_store, settings).poll()
        assert seen == {"payload": {"step": 7}, "host": "h1", "action": None}
    finally:
        unregister_handler("ctx")


def test_running_left_by_a_dead_agent_fails_without_rerun(sqlite_store, settings):
    cid = enqueue(sqlite_store)
    with sqlite_store.session() as s:
        assert [c.id for c in claim_pending(s, "h1")] == [cid]
    runner = runner_for(sqlite_store, settings)
    assert runner.recover() == 1
    assert row(sqlite_store, cid).status == "failed"
    assert runner.poll() == []


def test_enqueue_rejects_bad_input(sqlite_store, settings):
    with sqlite_store.session() as s:
        with pytest.raises(InvalidInput, match="payload must be a JSON object"):
            enqueue_command(s, "h1", "ping", ["not", "a", "dict"], 60, secret=SECRET)
        with pytest.raises(InvalidInput, match="ttl"):
            enqueue_command(s, "h1", "ping", {}, 0, secret=SECRET)
        with pytest.raises(InvalidInput, match="JSON"):
            enqueue_command(s, "h1", "ping", {"x": object()}, 60, secret=SECRET)
        with pytest.raises(InvalidInput, match="finishes as one of"):
            finish(s, 1, "maybe")
        with pytest.raises(NotFound):
            finish(s, 12345, "done")
    with sqlite_store.session() as s:
        assert s.query(Command).count() == 0  # nothing half-written


def test_a_command_under_the_fleet_settings_is_run(sqlite_store, settings):
    with sqlite_store.session() as s:  # the settings come from the caller: FLEETLENS_SECRET and the default ttl
        cid = enqueue_command(s, "h1", "ping", None, settings.command_ttl_s, secret=settings.secret_bytes()).id
    command = row(sqlite_store, cid)
    assert command.expires_at - command.issued_at == pytest.approx(settings.command_ttl_s)
    assert [o.status for o in runner_for(sqlite_store, settings).poll()] == ["done"]


def test_ledger_forgets_expired_nonces(tmp_path):
    path = tmp_path / "nonces"
    ledger = NonceLedger(path)
    ledger.add("old", time.time() - 1)
    ledger.add("new", time.time() + 100)
    with open(path, "a") as f:
        f.write('{"nonce": "torn')  # a crash mid-write
    again = NonceLedger(path)
    assert "new" in again and "old" not in again
