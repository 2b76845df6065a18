"""The serving SDK counts every request once, through a real agent into the store: a call with bad input is refused
before any of it is counted; what it accepts the agent takes (a coarse wall clock, an execution time measured on
another clock, numpy batch sizes); a message the agent refuses is given up and counted, never sent again; a batch
whose body raises or that the request queue gives up is shed, not served; one step back of the wall clock is one
step; a minute recorded partly before its SLO was known is not judged by the SDK."""

from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest

from collector import protocol as p
from collector import serving as serving_mode
from collector.serving import ServingRecorder
from enforcer.serving.distribution import Distributions, TimeGrid
from enforcer.serving.live import RequestQueue
from store.errors import InvalidInput
from store.serving import app_windows
from store.serving_raw import raw_requests
from store.settings import get_settings
from tests.serving.conftest import Agent


def _windows(agent: Agent) -> dict:
    agent.handlers.flush()
    with agent.store.session() as s:
        return {w.app: w for w in app_windows(s, 0.0, time.time() + 7200)}


def _totals(rec: ServingRecorder) -> tuple[int, int]:
    return sum(m.n for m in rec._pending.values()), sum(m.dropped for m in rec._pending.values())


def test_a_wall_clock_that_did_not_tick_still_gives_requests_the_agent_takes(agent, monkeypatch) -> None:
    rec = ServingRecorder("svc", slos={"a": 1.0}, settings=agent.settings, cuda=False)
    t = time.time()
    # end == start == arrival with an execution time below the wall clock's tick: its latency is its execution
    rec.record("a", arrival=t, start=t, end=t, exec_s=1e-7)
    # an execution time the wall clock contradicts (4 ms in a batch that took none) is refused, nothing counted
    with pytest.raises(InvalidInput, match="longer than its batch's start to end"):
        rec.record("a", arrival=t, start=t, end=t, exec_s=0.004)
    assert rec.recorded == 1
    # a batch timed while the wall clock stands still (a coarse clock)
    frozen = float(int(t))
    with monkeypatch.context() as m:
        m.setattr(serving_mode.time, "time", lambda: frozen)
        with rec.batch(["a", "b"], [frozen, frozen]):
            pass
    assert rec.recorded == 3
    assert rec.flush(force=True) and rec.sent == 3 and rec.lost == 0
    w = _windows(agent)
    assert (w["a"].n, w["b"].n) == (2, 1) and w["a"].latency_sum > 0 and w["a"].met() == 2


def test_an_execution_time_measured_on_another_clock_fits_its_raw_row(fleet_home, monkeypatch) -> None:
    monkeypatch.setenv("FLEETLENS_SERVING_RAW_REQUESTS", "1")
    agent = Agent(get_settings(fresh=True))
    try:
        rec = ServingRecorder("svc", settings=agent.settings, cuda=False)
        t = time.time()
        with pytest.raises(InvalidInput, match="longer than its batch's start to end"):
            rec.record("a", arrival=t, start=t, end=t + 0.01, exec_s=0.02)
        # CUDA events a hair past the wall clock's start to end (within its resolution and rate): taken, and its
        # raw row's latency is at least its execution time, as the agent requires
        rec.record("a", arrival=t, start=t, end=t + 0.01, exec_s=0.01 + 2e-7)
        for _ in range(200):
            with rec.batch("a", [time.time() + 10]):  # an arrival after the batch's start is taken as its start
                pass
        assert rec.flush(force=True) and rec.sent == 201 and rec.raw_sent == 201 and rec.lost == 0
        agent.handlers.flush()
        with agent.store.session() as s:
            rows = raw_requests(s, "svc")
        assert len(rows) == 201
        assert all(r.latency_s >= r.exec_s and r.latency_s >= r.wait_s for r in rows)
    finally:
        agent.stop()
        agent.store.dispose()


def test_a_batch_size_is_a_whole_number(agent) -> None:
    rec = ServingRecorder("svc", settings=agent.settings)
    t = time.time()
    for bad in (2.5, True, 0, "2"):
        with pytest.raises(InvalidInput, match="batch size"):
            rec.record("a", arrival=t, start=t, end=t + 0.01, batch_size=bad)
    with pytest.raises(InvalidInput, match="devices"):
        ServingRecorder("svc", settings=agent.settings, devices=1.5)
    assert rec.recorded == 0
    rec.record("a", arrival=t, start=t, end=t + 0.01, batch_size=np.int64(2))  # numpy's integers are integers
    rec2 = ServingRecorder("svc", settings=agent.settings, devices=np.int32(3))
    rec2.record("a", arrival=t, start=t, end=t + 0.01)
    assert rec.flush(force=True) and rec2.flush(force=True) and rec.sent == rec2.sent == 1
    w = _windows(agent)["a"]
    assert w.n == 2 and w.batch_sum == 3 and w.devices == 3


def test_a_message_the_agent_refuses_is_given_up_once_and_later_requests_arrive(agent) -> None:
    rec = ServingRecorder("svc", settings=agent.settings)
    t = time.time()
    for i in range(5):
        rec.record("a", arrival=t + i, start=t + i, end=t + i + 0.01)
    rec.shed("a", [t])
    rec.slos["a"] = -1.0  # an SLO set around set_slo's check: the agent refuses the message that carries it
    assert rec.flush(force=True)
    assert (rec.refused, rec.lost, rec.sent) == (1, 6, 0) and not rec._pending
    del rec.slos["a"]
    rec.record("a", arrival=t + 10, start=t + 10, end=t + 10.01)
    rec.close()
    assert (rec.refused, rec.lost, rec.sent) == (1, 6, 1)
    assert _windows(agent)["a"].n == 1


def test_many_minutes_go_in_messages_under_the_line_limit(agent) -> None:
    # more minutes waiting than one message can carry (protocol.MAX_LINE, 4 MiB): 300 app-minutes whose requests
    # take 1 us to 50 s, so that each histogram fills ~900 buckets; all sent in one flush
    rec = ServingRecorder("svc", settings=agent.settings.model_copy(update={"sdk_flush_interval_s": 3600.0}))
    t0 = time.time() - 3600
    t0 -= t0 % 60
    for minute in range(60):
        for k in range(1000):
            exec_s = 1e-6 * 10 ** (7.7 * k / 1000)
            for app in ("a", "b", "c", "d", "e"):
                a = t0 + minute * 60 + k * 0.05
                rec.record(app, arrival=a, start=a, end=a + exec_s, exec_s=exec_s)
    size = sum(len(json.dumps(m.record(*key))) for key, m in rec._pending.items())
    assert size > p.MAX_LINE
    assert rec.flush(force=True) and rec.sent == 300_000 and rec.lost == rec.refused == rec.clock_steps_back == 0
    assert sum(w.n for w in _windows(agent).values()) == 300_000
    with pytest.raises(InvalidInput, match="over 255"):  # the store's column: no single minute is too long either
        rec.record("x" * 256, arrival=t0, start=t0, end=t0 + 0.01)


def test_a_call_with_a_bad_request_counts_none_of_it(agent) -> None:
    rec = ServingRecorder("svc", settings=agent.settings, cuda=False)
    t = time.time()
    with pytest.raises(InvalidInput, match="arrival nan"):
        rec.shed("a", [t, t, math.nan])
    ran = []
    with pytest.raises(InvalidInput, match="no application"):
        with rec.batch(["a", ""], [t, t]):
            ran.append(1)
    with pytest.raises(InvalidInput, match="arrival inf"):
        with rec.batch("a", [t, math.inf]):
            ran.append(1)
    assert ran == [] and _totals(rec) == (0, 0) and rec.recorded == rec.shed_count == 0
    # a batch whose body raises (CUDA out of memory, say) served nobody: its members are dropped
    with pytest.raises(RuntimeError, match="out of memory"):
        with rec.batch("a", [t, t]):
            raise RuntimeError("CUDA out of memory")
    assert _totals(rec) == (0, 2) and rec.shed_count == 2
    rec.close()
    w = _windows(agent)["a"]
    assert (w.n, w.dropped) == (0, 2)


def _queue(clock: list[float]) -> RequestQueue:
    rng = np.random.default_rng(0)
    samples = {"a": rng.lognormal(np.log(0.01), 1.0, 500)}
    dists = Distributions.fit(TimeGrid.covering(samples["a"].max() * 1.01), samples)
    return RequestQueue(dists, {"a": 0.02}, 0.1, eps=0.1, stop_running=True, stop_eps=0.05, clock=lambda: clock[0])


def test_a_batch_the_queue_gives_up_is_counted_once_as_shed(agent) -> None:
    clock = [time.time()]
    q = _queue(clock)
    rec = ServingRecorder("svc", slos={"a": 0.02}, settings=agent.settings, cuda=False)
    q.submit("a", 1)
    given_up = q.next_batch(timeout=0)
    assert given_up is not None and given_up.stop_at is not None
    with rec.batch(given_up):  # the README's loop: the model gives the batch up past its stop_at
        clock[0] = given_up.stop_at + 1e-3
        if q.past_stop(given_up):
            q.stop(given_up)
    q.submit("a", 1)
    served = q.next_batch(timeout=0)
    with rec.batch(served):
        pass
    for r in q.dropped():
        rec.shed(r.app, [r.arrival])
    assert (q.served, q.shed) == (1, 1) and _totals(rec) == (1, 1)
    rec.close()
    w = _windows(agent)["a"]
    assert (w.n, w.dropped) == (1, 1)


def test_one_step_back_of_the_wall_clock_is_one_step_and_the_minutes_stay_in_order(agent) -> None:
    rec = ServingRecorder("svc", settings=agent.settings)
    t = time.time()
    t -= t % 60
    rec.record("a", arrival=t, start=t, end=t + 0.01)
    for i in range(600):  # the clock was set back an hour; ten minutes of requests, one a second
        a = t - 3600 + i
        rec.record("a", arrival=a, start=a, end=a + 0.01)
    assert rec.clock_steps_back == 1
    per_minute = [m.n for m in rec._pending.values()]
    assert sum(per_minute) == 601 and max(per_minute) <= 61  # not a burst: one a second in every minute
    # a request that waited in the queue longer than the tolerance is not a step back: it ends now
    rec.record("a", arrival=t + 600 - 90, start=t + 599, end=t + 600)
    assert rec.clock_steps_back == 1
    rec.close()
    assert _windows(agent)["a"].n == 602


def test_a_minute_recorded_partly_before_its_slo_was_known_is_not_judged_by_the_sdk(agent) -> None:
    rec = ServingRecorder("svc", settings=agent.settings)
    now = time.time()
    t0 = now - now % 60 + 1
    for i in range(100):  # all 10 ms, well within the SLO set afterwards
        rec.record("a", arrival=t0 + i * 0.01, start=t0 + i * 0.01, end=t0 + i * 0.01 + 0.01)
    rec.set_slo("a", 1.0)
    rec.record("a", arrival=t0 + 2, start=t0 + 2, end=t0 + 2.01)
    assert [m.met for m in rec._pending.values()] == [None]
    rec.close()
    w = _windows(agent)["a"]
    assert w.n == 101 and w.met() == 101 and w.attainment() == 1.0


def test_a_message_answered_too_late_is_sent_again_unchanged_and_counted_once(agent, monkeypatch) -> None:
    # the agent merges the first message but answers after the SDK stopped waiting (a busy agent on a loaded host)
    rec = ServingRecorder("svc", slos={"a": 1.0}, settings=agent.settings.model_copy(update={"sdk_timeout_s": 0.3}),
                          cuda=False)
    handle, calls = agent.handlers.serving.handle, []

    def late(msg: dict) -> bool:
        merged = handle(msg)
        calls.append(msg["seq"])
        if len(calls) == 1:
            time.sleep(0.8)
        return merged

    monkeypatch.setattr(agent.handlers.serving, "handle", late)
    t = time.time() - 5
    for _ in range(100):
        rec.record("a", arrival=t, start=t, end=t + 0.01)
    assert rec.flush(force=True) is False  # no answer in time: kept to be sent again
    for _ in range(7):  # recorded meanwhile, into the same minute
        rec.record("a", arrival=t, start=t, end=t + 0.01)
    time.sleep(0.8)
    assert rec.flush(force=True) is True
    rec.close()
    # the first message went again under its own number before the newer one, and was merged once
    assert calls == [1, 1, 2] and agent.handlers.serving.duplicates == 1
    assert (rec.recorded, rec.sent, rec.lost) == (107, 107, 0)
    assert _windows(agent)["a"].n == 107


def test_what_no_agent_took_by_close_is_counted_lost(fleet_home) -> None:
    rec = ServingRecorder("svc", settings=get_settings(fresh=True).model_copy(update={"sdk_timeout_s": 0.2}),
                          cuda=False)
    t = time.time()
    for _ in range(3):
        rec.record("a", arrival=t, start=t, end=t + 0.01)
    rec.shed("a", [t])
    rec.close()  # no agent listens
    assert (rec.recorded, rec.shed_count, rec.sent, rec.lost) == (3, 1, 0, 4)
