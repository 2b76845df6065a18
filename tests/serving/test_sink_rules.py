"""The agent's serving sink into the store, on SQLite and PostgreSQL: what it refuses (SLOs and histograms the
store could not use, over-long application names), what one workflow's unwritable data may not do to the others,
and the rules for merged counts (`met`), devices and SLOs."""

from __future__ import annotations

import pytest

from collector import serving_sink
from collector.serving_sink import ServingSink
from store import latency_sketch as ls
from store.db import Store
from store.errors import InvalidInput
from store.models_serving import ServingApp, ServingMinute
from store.serving import MAX_APP, app_windows, check_minute, set_slo
from store.serving_raw import check_raw
from store.settings import Settings


def _minute(app: str, minute: float, times: list[float], met: int | None = None) -> dict:
    h: dict[int, int] = {}
    for t in times:
        ls.add(h, t)
    return {"app": app, "minute": minute, "n": len(times), "dropped": 0, "met": met, "exec_sum": sum(times),
            "exec_sumsq": sum(t * t for t in times), "wait_sum": 0.0, "latency_sum": sum(times),
            "batch_sum": len(times), "exec_hist": ls.to_json(h), "latency_hist": ls.to_json(h)}


def _msg(wf: str, minutes: list[dict], *, slos: dict | None = None, devices: int = 1) -> dict:
    return {"workflow": wf, "pid": 1, "devices": devices, "slos": slos or {}, "minutes": minutes}


def _windows(store: Store, wf: str) -> dict:
    with store.session() as s:
        return {w.app: w for w in app_windows(s, 0.0, 1e9, [wf])}


@pytest.mark.parametrize("slos, why", [({"a": float("inf")}, "not a positive number"),
                                       ({"a": float("nan")}, "not a positive number"),
                                       ({"a": 0}, "not a positive number"),
                                       ({"": 1.0}, "no application"),
                                       ({"x" * (MAX_APP + 1): 1.0}, "more than 255")])
def test_an_slo_the_store_would_refuse_refuses_the_message(slos, why) -> None:
    sink = ServingSink()
    with pytest.raises(InvalidInput, match=why):
        sink.handle(_msg("svc", [_minute("a", 60.0, [0.1])], slos=slos))
    assert sink.refused_messages == 1 and sink.pending() == 0


def test_a_histogram_bucket_outside_the_finite_times_is_refused() -> None:
    for key in ("100000", str(ls.MAX_BUCKET + 1), str(ls.MIN_BUCKET - 1), "1.5", "x"):
        into = {3: 1}
        with pytest.raises(InvalidInput, match="bucket"):
            ls.merge(into, {"3": 1, key: 1})
        assert into == {3: 1}  # refused whole
    rec = {**_minute("a", 60.0, [0.1]), "exec_hist": {"100000": 1}}
    with pytest.raises(InvalidInput, match="'100000'"):
        check_minute(rec)
    sink = ServingSink()
    with pytest.raises(InvalidInput):
        sink.handle(_msg("svc", [rec]))
    # the extremes stay readable: a bucket's value is finite for every bucket a time can fall in
    assert all(0 < v < float("inf") for v in ls.quantiles({ls.MIN_BUCKET: 1, ls.MAX_BUCKET: 1}, (0.0, 1.0)))


def test_one_rule_for_application_names_everywhere(any_store: Store) -> None:
    """At most 255 characters: minutes, SLOs and raw requests refuse a longer name alike, never cut it."""
    long = "x" * (MAX_APP + 1)
    with pytest.raises(InvalidInput, match="more than 255"):
        check_minute(_minute(long, 60.0, [0.1]))
    with pytest.raises(InvalidInput, match="more than 255"):
        check_raw([long, 60.0, 0.0, 0.1, 0.1, 1])
    sink = ServingSink()
    with pytest.raises(InvalidInput, match="more than 255"):
        sink.handle(_msg("svc", [_minute(long, 60.0, [0.1])]))
    # the longest name the rule allows is stored whole, with its SLO, on both databases
    name = "y" * MAX_APP
    sink.handle(_msg("svc", [_minute(name, 60.0, [0.1, 3.0], met=1)], slos={name: 1.0}))
    sink.write(any_store)
    w = _windows(any_store, "svc")[name]
    assert (w.n, w.slo_s, w.met()) == (2, 1.0, 1)
    with any_store.session() as s, pytest.raises(InvalidInput, match="more than 255"):
        set_slo(s, "svc", long, 1.0)


def test_a_workflow_the_store_refuses_is_counted_and_never_stalls_the_others(any_store, monkeypatch) -> None:
    real = serving_sink.merge_minutes
    refusals = {"evil": 99, "flaky": 1}  # refusals to come, per workflow

    def refuse(session, wf, recs, **kw):
        if refusals.get(wf, 0) > 0:
            refusals[wf] -= 1
            raise ValueError(f"the store refused {wf}")
        return real(session, wf, recs, **kw)

    monkeypatch.setattr(serving_sink, "merge_minutes", refuse)
    sink = ServingSink()
    for wf in ("evil", "flaky", "good"):
        sink.handle(_msg(wf, [_minute("a", 60.0, [0.1, 0.2])]))
    assert sink.write(any_store) == 2  # good written, the two others kept for the next write
    assert (sink.unwritable, sink.pending()) == (0, 4)
    sink.handle(_msg("good", [_minute("a", 120.0, [0.1])]))
    assert sink.write(any_store) == 3  # flaky's refusal passed: written once, nothing lost
    assert (sink.unwritable, sink.pending()) == (0, 2)
    sink.handle(_msg("evil", [_minute("a", 120.0, [0.1])]))
    assert sink.write(any_store) == 0  # evil's third refusal in a row: given up, counted
    assert (sink.unwritable, sink.pending(), sink.written) == (3, 0, 5)
    assert sink.write(any_store) == 0
    assert [_windows(any_store, wf)["a"].n for wf in ("good", "flaky")] == [3, 2]
    assert _windows(any_store, "evil") == {}


def test_data_the_store_cannot_take_holds_up_none_of_the_agents_other_writes(agent) -> None:
    """The reviewer's case: before, an SLO of Infinity (the socket's JSON allows it) made every write fail."""
    import json

    from collector import protocol as p

    good = {"op": p.SERVING, "v": p.VERSION, "workflow": "good", "pid": 1, "minutes": [_minute("a", 60.0, [0.1])]}
    bad = json.loads(json.dumps({**good, "workflow": "evil", "slos": {"a": float("inf")}}))
    reply = agent.handlers.handle(bad)
    assert not reply["ok"] and "not a positive number" in reply["error"]
    assert agent.handlers.handle(good)["ok"]
    agent.handlers.flush()
    assert _windows(agent.store, "good")["a"].n == 1 and agent.handlers.serving.pending() == 0


def test_a_minute_with_requests_of_unknown_slo_has_no_exact_met(any_store: Store) -> None:
    """met=None (no SLO known) merged with a count gives None, in the sink and in the store; a part that served
    nothing (shed only, or a new row) does not make it unknown."""
    fast = [0.01] * 100
    one = ServingSink()  # one agent: a host without the SLO and one with it, in the same minute
    one.handle(_msg("svc", [_minute("a", 60.0, fast)]))
    one.handle(_msg("svc", [_minute("a", 60.0, [0.01], met=1)], slos={"a": 1.0}))
    one.write(any_store)
    other = ServingSink()  # two agents adding into the same row, the first with the SLO
    other.handle(_msg("svc", [_minute("b", 60.0, [0.01], met=1)], slos={"b": 1.0}))
    other.write(any_store)
    other.handle(_msg("svc", [_minute("b", 60.0, fast)]))
    other.write(any_store)
    shed = ServingSink()  # shed requests only, no SLO known: they missed, whatever the SLO
    shed.handle(_msg("svc", [{**_minute("c", 60.0, []), "dropped": 5}]))
    shed.handle(_msg("svc", [_minute("c", 60.0, [0.01, 5.0], met=1)], slos={"c": 1.0}))
    shed.write(any_store)
    with any_store.session() as s:
        mets = {r.app: r.met for r in s.query(ServingMinute).filter_by(workflow_id="svc")}
    assert mets == {"a": None, "b": None, "c": 1}
    w = _windows(any_store, "svc")
    assert w["a"].met() == w["b"].met() == 101  # from the latency histogram, against the SLO
    assert w["c"].attainment() == pytest.approx(1 / 7)


def test_devices_are_what_the_service_reports_in_each_minute(any_store: Store) -> None:
    sink = ServingSink()
    sink.handle(_msg("svc", [_minute("a", 60.0, [0.1])], slos={"a": 1.0}, devices=4))
    sink.write(any_store)
    sink.handle(_msg("svc", [_minute("a", 600.0, [0.1])], slos={"a": 1.0}, devices=2))  # restarted on 2
    sink.handle(_msg("svc", [_minute("a", 660.0, [0.1])], slos={"a": 1.0}, devices=2))
    sink.write(any_store)
    replica = ServingSink()  # another host's agent: a minute keeps the largest any replica reported for it
    replica.handle(_msg("svc", [_minute("a", 660.0, [0.1])], slos={"a": 1.0}, devices=3))
    replica.write(any_store)
    with any_store.session() as s:
        rows = {r.minute: r.devices for r in s.query(ServingMinute).filter_by(workflow_id="svc")}
        assert rows == {60.0: 4, 600.0: 2, 660.0: 3}
        assert [w.devices for w in app_windows(s, 0.0, 650.0)] == [2]  # the window's newest minute: held now
        assert [w.devices for w in app_windows(s, 0.0, 120.0)] == [4]


def test_the_operators_slo_wins_over_the_sdks_and_the_agent_never_resets_its_target(any_store: Store) -> None:
    sink = ServingSink(Settings())
    sink.handle(_msg("svc", [_minute("a", 60.0, [0.1, 0.5], met=2)], slos={"a": 1.0}))
    sink.write(any_store)
    with any_store.session() as s:  # the SDK's SLO filled in the missing row
        assert (s.get(ServingApp, ("svc", "a")).slo_s, s.get(ServingApp, ("svc", "a")).target) == (1.0, 0.99)
        set_slo(s, "svc", "a", 0.2, target=0.9)  # what `fleetlens serving slo svc a 0.2 --target 0.9` does
    sink.handle(_msg("svc", [_minute("a", 120.0, [0.1, 0.5], met=2)], slos={"a": 1.0}))
    sink.write(any_store)
    with any_store.session() as s:
        row = s.get(ServingApp, ("svc", "a"))
        assert (row.slo_s, row.target) == (0.2, 0.9)
    # the SDK counted `met` against its own 1 s, before the operator's SLO and after it: against the operator's
    # 0.2 s, met comes from the histogram, for the minute stored before the change too
    w = _windows(any_store, "svc")["a"]
    assert (w.met(), w.n) == (2, 4)
    with any_store.session() as s:
        (before,) = app_windows(s, 0.0, 120.0)
    assert (before.met(), before.n) == (1, 2)


def test_a_message_sent_again_under_the_same_seq_is_counted_once(agent) -> None:
    """The SDK sends a message again when the agent's reply came after its timeout: with the same sender and
    seq, the agent acknowledges it and does not count it twice."""
    from collector import protocol as p

    msg = {"op": p.SERVING, "v": p.VERSION, "workflow": "svc", "pid": 7, "sender": "rec-1", "seq": 1,
           "minutes": [_minute("a", 60.0, [0.1, 0.2])]}
    assert agent.handlers.handle(msg) == {"ok": True}
    assert agent.handlers.handle(msg) == {"ok": True, "duplicate": True}  # the resend
    assert agent.handlers.handle({**msg, "seq": 2, "minutes": [_minute("a", 60.0, [0.3])]}) == {"ok": True}
    assert agent.handlers.handle({**msg, "sender": "rec-2"})["ok"]  # another recorder's first message
    assert agent.handlers.handle({**msg, "pid": 8})["ok"]  # another process's
    reply = agent.handlers.handle({**msg, "seq": 0})
    assert not reply["ok"] and "seq=0" in reply["error"]
    assert agent.handlers.serving.duplicates == 1
    agent.handlers.flush()
    assert _windows(agent.store, "svc")["a"].n == 7
