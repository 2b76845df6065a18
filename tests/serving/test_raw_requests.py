"""Raw serving requests are opt-in and capped: off by default nothing is stored; on, each workflow keeps its newest
rows up to the cap and counts those they replace; bad raw records are refused with the reason; retention deletes
rows by age."""

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


def test_on_keeps_the_newest_up_to_the_cap_and_counts_those_they_replace(fleet_home, monkeypatch) -> None:
    agent = _agent(monkeypatch, FLEETLENS_SERVING_RAW_REQUESTS="1", FLEETLENS_SERVING_RAW_MAX_ROWS="50")
    monkeypatch.setattr(serving_mode, "RAW_PER_MESSAGE", 7)  # raw requests go in several messages a flush
    try:
        rec = _serve(agent, 120, flushes=4)  # 30 a flush: the SDK's buffer never reaches the cap
        assert (rec.raw_sent, rec.raw_over_cap) == (120, 0)
        with agent.store.session() as s:
            rows = raw_requests(s, "svc")
            assert raw_counts(s, "svc") == (50, 70)
            assert {w.app: w.n for w in app_windows(s, 0.0, time.time() + 120)} == {"a": 120}
        # the newest 50 requests (70..119), as measured: wait 2 ms, execution 1..5 ms, latency = wait + execution
        assert [r.batch_size for r in rows] == [1 + i % 3 for i in range(70, 120)]
        assert [round(r.exec_s * 1000) for r in rows] == [1 + i % 5 for i in range(70, 120)]
        assert all(abs(r.wait_s - 0.002) < 1e-6 and abs(r.latency_s - r.wait_s - r.exec_s) < 1e-6 for r in rows)
        # a recorder whose own buffer is full keeps its newest rows too, counts those they replace, and the store
        # adds it up: the 50 newer rows take the place of all 50 stored ones
        rec2 = ServingRecorder("svc", settings=agent.settings)
        t = time.time()
        for i in range(80):
            rec2.record("a", arrival=t + i * 1e-3, start=t + i * 1e-3, end=t + i * 1e-3 + 0.001 * (1 + i % 7))
        assert rec2.raw_over_cap == 30
        rec2.close()
        agent.handlers.flush()
        with agent.store.session() as s:
            assert raw_counts(s, "svc") == (50, 150)
            assert [round(r.exec_s * 1000) for r in raw_requests(s, "svc")] == [1 + i % 7 for i in range(30, 80)]
    finally:
        agent.stop()
        agent.store.dispose()


def test_the_store_keeps_the_newest_rows_while_requests_keep_coming_and_retention_deletes_by_age(
        fleet_home, monkeypatch) -> None:
    agent = _agent(monkeypatch, FLEETLENS_SERVING_RAW_REQUESTS="1", FLEETLENS_SERVING_RAW_MAX_ROWS="5")
    try:
        rec = ServingRecorder("svc", settings=agent.settings)
        t0 = time.time() - 100
        served: list[float] = []

        def serve(n: int) -> list[float]:
            for _ in range(n):
                t = t0 + len(served)
                served.append(t)
                rec.record("a", arrival=t, start=t, end=t + 0.01)
            assert rec.flush(force=True)
            agent.handlers.flush()
            with agent.store.session() as s:
                return [r.arrival for r in raw_requests(s, "svc")]

        assert serve(4) == served  # under the cap: all kept
        assert serve(3) == served[-5:]  # the two oldest gave way
        assert serve(20) == served[-5:]  # a full cap never stops new rows coming in
        # between two flushes the SDK's own buffer (the cap too) kept the newest 5 of the 20 and sent the 15 it let go
        # as a count
        assert rec.raw_sent == 12 and rec.raw_over_cap == 0
        with agent.store.session() as s:
            assert raw_counts(s, "svc") == (5, 22)  # every request so far: stored or counted
            assert delete_raw_before(s, served[-2]) == 3  # retention deletes by age, and the stored count with it
            assert raw_counts(s, "svc") == (2, 22)
        assert serve(2) == served[-4:]  # room under the cap again: nothing replaced
        rec.close()
        agent.handlers.flush()
        with agent.store.session() as s:
            assert raw_counts(s, "svc") == (4, 22)
            assert {w.app: w.n for w in app_windows(s, 0.0, time.time() + 120)} == {"a": 29}
    finally:
        agent.stop()
        agent.store.dispose()


def test_while_no_agent_listens_the_sdk_keeps_its_newest_rows_and_counts_the_rest(fleet_home, monkeypatch) -> None:
    for k, v in {"FLEETLENS_SERVING_RAW_REQUESTS": "1", "FLEETLENS_SERVING_RAW_MAX_ROWS": "10"}.items():
        monkeypatch.setenv(k, v)
    settings = get_settings(fresh=True)
    settings.ensure_home()
    rec = ServingRecorder("svc", settings=settings)
    t = time.time() - 60
    for i in range(25):
        rec.record("a", arrival=t + i, start=t + i, end=t + i + 0.001 * (1 + i))
    assert not rec.flush(force=True) and rec.raw_over_cap == 15  # no agent: nothing sent, the oldest 15 let go
    agent = Agent(settings)
    try:
        assert rec.flush(force=True) and (rec.raw_sent, rec.raw_over_cap) == (10, 0)
        rec.close()
        agent.handlers.flush()
        with agent.store.session() as s:
            assert raw_counts(s, "svc") == (10, 15)
            assert [round(r.exec_s * 1000) for r in raw_requests(s, "svc")] == list(range(16, 26))  # the newest 10
            assert {w.app: w.n for w in app_windows(s, 0.0, time.time() + 120)} == {"a": 25}
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


def test_retention_deletes_old_rows_and_an_older_row_never_replaces_a_newer_one(any_store) -> None:
    day = 86400.0
    rows = [{"app": "a", "arrival": float(t) * 3600.0, "wait_s": 0.0, "exec_s": 1.0, "latency_s": 1.0,
             "batch_size": 1} for t in range(10)]
    with any_store.session() as s:
        upsert_workflow(s, "svc", id_source="env")
        assert write_raw(s, "svc", rows, 6) == (6, 4)  # hours 4..9 kept, the 4 before counted
    # retention of one day at 6 h past a day: the rows that arrived before hour 6 go, with the samples' retention
    kept = apply_retention(any_store, 1.0, now=day + 6 * 3600.0)
    assert kept.serving_requests_deleted == 2
    with any_store.session() as s:
        assert raw_counts(s, "svc") == (4, 4)
        assert [r.arrival / 3600.0 for r in raw_requests(s, "svc")] == [6.0, 7.0, 8.0, 9.0]
        # three late rows (hours 0..2) come in: two fit under the cap; the oldest of all, hour 0, is counted
        assert write_raw(s, "svc", rows[:3], 6) == (3, 1)
        assert raw_counts(s, "svc") == (6, 5)
        assert [r.arrival / 3600.0 for r in raw_requests(s, "svc")] == [1.0, 2.0, 6.0, 7.0, 8.0, 9.0]
        assert write_raw(s, "svc", rows[:1], 6) == (1, 1)  # older than everything kept: it is the one that goes
        assert [r.arrival / 3600.0 for r in raw_requests(s, "svc")] == [1.0, 2.0, 6.0, 7.0, 8.0, 9.0]
        # a cap lowered to 0 keeps none: the new rows and the 6 stored are all counted
        assert write_raw(s, "svc", rows[:2], 0) == (0, 8) and raw_counts(s, "svc") == (0, 14)
        assert delete_raw_before(s, 0.0) == 0
