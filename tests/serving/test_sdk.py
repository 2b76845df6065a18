"""The SDK's serving mode through a real agent socket into the store: exact counts, shed requests counted, bad
input refused with a reason, nothing lost while no agent listens."""

from __future__ import annotations

import time

import pytest

from collector import protocol as p
from collector.serving import ServingRecorder
from store.errors import InvalidInput
from store.serving import app_windows
from store.settings import get_settings


def _windows(agent) -> dict:
    agent.handlers.flush()
    with agent.store.session() as s:
        return {w.app: w for w in app_windows(s, 0.0, time.time() + 120)}


def test_requests_arrive_in_the_store_exactly(agent) -> None:
    now = time.time()
    with ServingRecorder("svc", slos={"a": 0.05}, devices=3, settings=agent.settings) as rec:
        for i in range(1000):
            t = now - 30 + i * 0.01
            rec.record("a" if i % 4 else "b", arrival=t, start=t + 0.001, end=t + 0.001 + 0.01 * (1 + i % 7),
                       batch_size=2)
        rec.shed("a", [now - 1.0, now - 0.5])
    assert rec.sent == 1002 and rec.lost == 0
    w = _windows(agent)
    assert w["a"].n == 750 and w["b"].n == 250 and w["a"].dropped == 2
    assert w["a"].devices == 3 and w["a"].slo_s == 0.05 and w["b"].slo_s is None
    # met is the SDK's exact count: latency = 1 ms wait + 10..70 ms execution; <= 50 ms for 1..4 of every 7
    want = sum(1 for i in range(1000) if i % 4 and 0.001 + 0.01 * (1 + i % 7) <= 0.05)
    assert w["a"].met() == want


def test_bad_requests_are_refused_with_the_reason(agent) -> None:
    rec = ServingRecorder("svc", settings=agent.settings)
    t = time.time()
    with pytest.raises(InvalidInput, match="no application"):
        rec.record("", arrival=t, start=t, end=t + 1)
    with pytest.raises(InvalidInput, match="not positive"):
        rec.record("a", arrival=t, start=t, end=t)
    with pytest.raises(InvalidInput, match="before it arrived"):
        rec.record("a", arrival=t, start=t - 1, end=t + 1)
    with pytest.raises(InvalidInput, match="before it started"):
        rec.record("a", arrival=t, start=t + 2, end=t + 1)
    assert rec.recorded == 0
    # a wall clock stepping back by minutes is counted, and the request still counted
    rec.record("a", arrival=t, start=t, end=t + 0.1)
    rec.record("a", arrival=t - 600, start=t - 600, end=t - 599.9)
    assert rec.clock_steps_back == 1 and rec.recorded == 2
    rec.close()
    assert _windows(agent)["a"].n == 2
    # the agent refuses a message whose histogram does not add up, and says why
    bad = {"op": p.SERVING, "v": p.VERSION, "workflow": "svc", "pid": 1, "minutes": [
        {"app": "a", "minute": 60.0, "n": 3, "exec_hist": {"10": 1}, "latency_hist": {"10": 1}}]}
    reply = agent.handlers.handle(bad)
    assert not reply["ok"] and "n says 3" in reply["error"]
    assert agent.handlers.serving.refused_messages == 1


def test_nothing_is_lost_while_no_agent_listens(fleet_home) -> None:
    from tests.serving.conftest import Agent

    settings = get_settings(fresh=True)
    settings.ensure_home()
    rec = ServingRecorder("svc", settings=settings)
    t = time.time()
    for i in range(100):
        rec.record("a", arrival=t + i * 0.001, start=t + i * 0.001, end=t + i * 0.001 + 0.01)
    assert not rec.flush(force=True) and rec.sent == 0
    agent = Agent(settings)
    try:
        assert rec.flush(force=True) and rec.sent == 100
        rec.close()
        assert _windows(agent)["a"].n == 100
    finally:
        agent.stop()
        agent.store.dispose()
