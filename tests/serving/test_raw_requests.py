"""Raw serving requests are opt-in and capped: off by default nothing is stored; on, each workflow keeps up to
the cap and the rest are counted; bad raw records are refused with the reason; retention frees the cap."""

from __future__ import annotations

import re
import time

import pytest

from analyzer.rollups import apply_retention
from collector import protocol as p
from collector import serving as serving_mode
from collector.serving import ServingRecorder
from store.serving import app_windows
from store.serving_raw import delete_raw_before, raw_counts, raw_requests, write_raw
from store.settings import get_settings
from store.workflows import upsert_workflow
from tests.serving.conftest import Agent


def _serve(agent: Agent, n: int, *, flushes: int = 2) -> ServingRecorder:
    now = time.time()
    rec = ServingRecorder("svc", settings=agent.settings)
    for i in range(n):
        t = now - 30 + i * 0.01
        rec.record("a", arrival=t, start=t + 0.002, end=t + 0.002 + 0.001 * (1 + i % 5), batch_size=1 + i % 3)
        if (i + 1) % (n // flushes) == 0:
            assert rec.flush(force=True)
    rec.close()
    agent.handlers.flush()
    return rec


def _agent(monkeypatch: pytest.MonkeyPatch, **env: str) -> Agent:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return Agent(get_settings(fresh=True))


def test_off_by_default_nothing_raw_is_sent_or_stored(fleet_home, monkeypatch) -> None:
    agent = _agent(monkeypatch)
    try:
        assert not agent.settings.serving_raw_requests
        rec = _serve(agent, 100)
        assert rec.raw_sent == 0 and rec.raw_over_cap == 0
        with agent.store.session() as s:
            assert raw_requests(s, "svc") == [] and raw_counts(s, "svc") == (0, 0)
            assert {w.app: w.n for w in app_windows(s, 0.0, time.time() + 120)} == {"a": 100}
    finally:
        agent.stop()
        agent.store.dispose()


def test_on_keeps_up_to_the_cap_and_counts_the_rest(fleet_home, monkeypatch) -> None:
    agent = _agent(monkeypatch, FLEETLENS_SERVING_RAW_REQUESTS="1", FLEETLENS_SERVING_RAW_MAX_ROWS="50")
    monkeypatch.setattr(serving_mode, "RAW_PER_MESSAGE", 7)  # raw requests go in several messages a flush
    try:
        rec = _serve(agent, 120, flushes=4)  # 30 a flush: the SDK's buffer never reaches the cap
        # rows go until the agent answers that the store's cap is full (after a write on its beat), then are counted
        assert 50 <= rec.raw_sent <= 120
        with agent.store.session() as s:
            rows = raw_requests(s, "svc")
            assert raw_counts(s, "svc") == (50, 70)
            assert {w.app: w.n for w in app_windows(s, 0.0, time.time() + 120)} == {"a": 120}
        assert len(rows) == 50
        # the first 50 requests, as measured: wait 2 ms, execution 1..5 ms, latency = wait + execution
        assert [r.batch_size for r in rows] == [1 + i % 3 for i in range(50)]
        assert [round(r.exec_s * 1000) for r in rows] == [1 + i % 5 for i in range(50)]
        assert all(abs(r.wait_s - 0.002) < 1e-6 and abs(r.latency_s - r.wait_s - r.exec_s) < 1e-6 for r in rows)
        # a recorder whose own buffer is full counts the excess and the store adds it up
        rec2 = ServingRecorder("svc", settings=agent.settings)
        t = time.time()
        for i in range(80):
            rec2.record("a", arrival=t + i * 1e-3, start=t + i * 1e-3, end=t + i * 1e-3 + 0.01)
        assert rec2.raw_over_cap == 30
        rec2.close()
        agent.handlers.flush()
        with agent.store.session() as s:
            assert raw_counts(s, "svc") == (50, 150)
    finally:
        agent.stop()
        agent.store.dispose()


def test_once_the_cap_is_full_the_sdk_counts_rows_instead_of_sending_them_until_retention_frees_room(
        fleet_home, monkeypatch) -> None:
    agent = _agent(monkeypatch, FLEETLENS_SERVING_RAW_REQUESTS="1", FLEETLENS_SERVING_RAW_MAX_ROWS="5")
    try:
        rec = ServingRecorder("svc", settings=agent.settings)
        t = time.time()

        def serve(n: int) -> None:
            for _ in range(n):
                rec.record("a", arrival=t, start=t, end=t + 0.01)
            assert rec.flush(force=True)

        serve(4)
        agent.handlers.flush()  # the store holds 4 of 5
        serve(3)  # the answer: room left; the store keeps 1 more and counts 2 once the agent writes
        agent.handlers.flush()
        assert (rec.raw_sent, rec.raw_full) == (7, False)
        serve(1)  # the agent's answer to this message: the cap is full
        assert rec.raw_full and rec.raw_sent == 8
        serve(20)  # counted by the SDK and sent as a count, not as rows
        assert rec.raw_sent == 8
        agent.handlers.flush()
        with agent.store.session() as s:
            assert raw_counts(s, "svc") == (5, 23)  # every request so far: stored or counted
            assert delete_raw_before(s, t + 1) == 5  # retention frees the cap
        serve(1)  # counted still (the agent learns of the room at its next write)
        agent.handlers.flush()
        serve(1)  # the answer: there is room again
        assert not rec.raw_full
        serve(2)
        assert rec.raw_sent == 10
        rec.close()
        agent.handlers.flush()
        with agent.store.session() as s:
            assert raw_counts(s, "svc") == (2, 25)
            assert {w.app: w.n for w in app_windows(s, 0.0, time.time() + 120)} == {"a": 32}
    finally:
        agent.stop()
        agent.store.dispose()


def test_bad_raw_records_are_refused_with_the_reason(fleet_home, monkeypatch) -> None:
    agent = _agent(monkeypatch, FLEETLENS_SERVING_RAW_REQUESTS="1")
    try:
        minute = {"app": "a", "minute": 60.0, "n": 1, "exec_hist": {"10": 1}, "latency_hist": {"10": 1}}
        cases = [([["", 60.0, 0.0, 1.0, 1.0, 1]], "no application"),
                 ([["a", 60.0, 0.0, -1.0, 1.0, 1]], "do not fit"),
                 ([["a", 60.0, 0.0, 1.0, 1.0, 0]], "batch_size"),
                 ([["a", 60.0]], r"is not \[app")]
        for raw, why in cases:
            msg = {"op": p.SERVING, "v": p.VERSION, "workflow": "svc", "pid": 1, "minutes": [minute], "raw": raw}
            reply = agent.handlers.handle(msg)
            assert not reply["ok"]
            assert re.search(why, reply["error"]), reply["error"]
        assert agent.handlers.serving.refused_messages == 4
    finally:
        agent.stop()
        agent.store.dispose()


def test_retention_deletes_old_rows_and_frees_the_cap(any_store) -> None:
    day = 86400.0
    rows = [{"app": "a", "arrival": float(t) * 3600.0, "wait_s": 0.0, "exec_s": 1.0, "latency_s": 1.0,
             "batch_size": 1} for t in range(10)]
    with any_store.session() as s:
        upsert_workflow(s, "svc", id_source="env")
        assert write_raw(s, "svc", rows, 6) == (6, 4)
    # retention of one day at 3 h past a day: the rows that arrived before hour 3 go, with the samples' retention
    kept = apply_retention(any_store, 1.0, now=day + 3 * 3600.0)
    assert kept.serving_requests_deleted == 3
    with any_store.session() as s:
        assert raw_counts(s, "svc") == (3, 4)
        assert [r.arrival / 3600.0 for r in raw_requests(s, "svc")] == [3.0, 4.0, 5.0]
        assert write_raw(s, "svc", rows[6:], 6) == (3, 1)  # the freed places take new rows; the rest counted
        assert raw_counts(s, "svc") == (6, 5)
        assert delete_raw_before(s, 0.0) == 0
