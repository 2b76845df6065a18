"""The per-lane iteration gate: one step per lane at a time, in the policy's order, through the agent's real socket
with real training jobs; a dead holder never blocks its lane for good."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from collector.sdk_handlers import SdkHandlers
from collector.socket_server import SocketServer
from enforcer.gate import LaneGate
from store.db import Store
from store.migrations import upgrade
from store.settings import get_settings
from tests.conftest import PROJECT_ROOT


def run_steps(gate: LaneGate, lane: str, key: tuple[str, int, int], steps: int, work_s: float,
              log: list[tuple[str, float, float]], lock: threading.Lock) -> None:
    for step in range(steps):
        gate.begin(lane, key, step, timeout=30)
        start = time.monotonic()
        time.sleep(work_s)
        end = time.monotonic()
        with lock:
            log.append((key[0], start, end))
        gate.end(lane, key)


def no_overlap(log: list[tuple[str, float, float]]) -> None:
    ordered = sorted(log, key=lambda x: x[1])
    for (a, _, a_end), (b, b_start, _) in zip(ordered, ordered[1:], strict=False):
        assert a_end <= b_start, f"{a} and {b} ran a step at the same time in one lane"


@pytest.mark.parametrize("policy", ["pack", "fifo"])
def test_two_jobs_in_one_lane_take_turns_one_step_at_a_time(policy: str) -> None:
    gate = LaneGate(policy, reserve_s=0.2)
    log: list[tuple[str, float, float]] = []
    lock = threading.Lock()
    threads = [threading.Thread(target=run_steps, args=(gate, "1", (name, 1, 0), 20, 0.002, log, lock))
               for name in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    no_overlap(log)
    order = [name for name, _, _ in sorted(log, key=lambda x: x[1])]
    assert order.count("a") == order.count("b") == 20
    switches = sum(1 for x, y in zip(order, order[1:], strict=False) if x != y)
    if policy == "pack":
        # steps in the order they were asked for: while both wait, they alternate
        assert switches >= 30
    else:
        # job order: the first job takes its steps until it is done, then the other
        assert switches == 1


def test_lanes_run_in_parallel() -> None:
    gate = LaneGate("fifo")
    gate.begin("1", ("a", 1, 0))
    # another lane is not blocked by lane 1's holder
    assert gate.begin("2", ("b", 2, 0), timeout=1) == 0.0
    gate.end("1", ("a", 1, 0))
    gate.end("2", ("b", 2, 0))


def wait_queued(gate: LaneGate, lane: str, n: int) -> None:
    """Until `n` jobs wait for the lane's turn (threads asking for it may take a while to get there)."""
    deadline = time.monotonic() + 10
    while len(gate.snapshot().get(lane, {}).get("waiting", [])) < n:
        assert time.monotonic() < deadline, gate.snapshot()
        time.sleep(0.005)


def test_fair_gives_the_next_step_to_the_job_with_least_attained_time() -> None:
    gate = LaneGate("fair")
    heavy, light, holder = ("heavy", 1, 0), ("light", 2, 0), ("holder", 3, 0)
    for key, held in ((heavy, 0.05), (light, 0.001)):  # their history: heavy has used the device much more
        gate.begin("1", key)
        time.sleep(held)
        gate.end("1", key)
    gate.begin("1", holder)
    order: list[str] = []
    lock = threading.Lock()

    def wait_turn(key: tuple[str, int, int]) -> None:
        gate.begin("1", key, timeout=10)
        with lock:
            order.append(key[0])
        gate.end("1", key)

    t_heavy = threading.Thread(target=wait_turn, args=(heavy,))
    t_heavy.start()
    wait_queued(gate, "1", 1)  # heavy asked first ...
    t_light = threading.Thread(target=wait_turn, args=(light,))
    t_light.start()
    wait_queued(gate, "1", 2)
    gate.end("1", holder)
    t_heavy.join()
    t_light.join()
    assert order == ["light", "heavy"]  # ... but light, with less attained time, goes first


def test_srtf_gives_the_next_step_to_the_job_with_least_remaining_time() -> None:
    totals = {"long": 10_000, "short": 20}
    gate = LaneGate("srtf", total_steps=totals.get)
    long_, short, holder = ("long", 1, 0), ("short", 2, 0), ("holder", 3, 0)
    for key in (long_, short):
        gate.begin("1", key, 10)
        time.sleep(0.002)
        gate.end("1", key)
    gate.begin("1", holder)
    order: list[str] = []

    def wait_turn(key: tuple[str, int, int]) -> None:
        gate.begin("1", key, 11, timeout=10)
        order.append(key[0])
        gate.end("1", key)

    threads = [threading.Thread(target=wait_turn, args=(k,)) for k in (long_, short)]
    threads[0].start()
    wait_queued(gate, "1", 1)
    threads[1].start()
    wait_queued(gate, "1", 2)
    gate.end("1", holder)
    for t in threads:
        t.join()
    assert order == ["short", "long"]


def test_a_holder_that_died_mid_step_loses_the_turn_after_its_lease() -> None:
    gate = LaneGate("fifo", lease_s=0.3)
    gate.begin("1", ("dead", 1, 0))  # never ends its step
    waited = gate.begin("1", ("alive", 2, 0), timeout=5)
    assert 0.2 <= waited < 5
    assert gate.snapshot()["1"]["holder"] == ("alive", 2, 0)


def test_unknown_policy_is_refused() -> None:
    from store.errors import InvalidInput

    with pytest.raises(InvalidInput, match="unknown policy 'bogus'"):
        LaneGate("bogus")


class RecordingGate(LaneGate):
    """The real gate, noting when each job held the turn (between its begin's grant and its end)."""

    def __init__(self) -> None:
        super().__init__("fifo")
        self.log: list[tuple[str, float, float]] = []
        self._granted: dict[tuple[str, int, int], float] = {}
        self._lock = threading.Lock()

    def handle(self, msg: dict[str, Any]) -> dict[str, Any]:
        key = (msg["workflow"], int(msg["pid"]), 0)
        if msg["phase"] == "end":
            with self._lock:
                start = self._granted.pop(key, None)
                if start is not None:
                    self.log.append((msg["workflow"], start, time.monotonic()))
            return super().handle(msg)
        reply = super().handle(msg)
        with self._lock:
            self._granted[key] = time.monotonic()
        return reply


@pytest.mark.slow
def test_real_training_jobs_in_one_lane_never_run_a_step_at_the_same_time(fleet_home: Path) -> None:
    settings = get_settings(fresh=True)
    settings.ensure_home()
    store = Store.from_settings(settings)
    upgrade(store)
    handlers = SdkHandlers(store, "gate-host", settings, sync_interval_s=0.2)
    gate = RecordingGate()
    handlers.gate = gate
    server = SocketServer(settings.socket_path, handlers).start()
    try:
        env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT), "FLEETLENS_LANE": "7",
               "FLEETLENS_SDK_FLUSH_INTERVAL_S": "0.1"}
        procs = [subprocess.Popen([sys.executable, "-m", "collector.examples.train", "--steps", "150",
                                   "--step-sleep", "0.002"], env={**env, "FLEETLENS_WORKFLOW": name}, cwd=PROJECT_ROOT,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for name in ("lane-a", "lane-b")]
        for proc in procs:
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err
    finally:
        server.stop()
        handlers.close()
        store.dispose()
    counts = {name: sum(1 for n, _, _ in gate.log if n == name) for name in ("lane-a", "lane-b")}
    assert counts == {"lane-a": 150, "lane-b": 150}  # every step of both jobs went through the gate
    no_overlap(gate.log)
    assert gate.snapshot()["7"]["turns"] == 300


def test_the_agent_hosts_the_gate_and_runs_the_enforcers_commands(fleet_home: Path) -> None:
    from collector.agent import Agent
    from collector.command_runner import registered_kinds
    from tests.collector.agent_helpers import StubSource

    settings = get_settings(fresh=True).model_copy(update={"policy": "fair", "host_id": "gate-agent"})
    settings.ensure_home()
    store = Store.from_settings(settings)
    upgrade(store)
    agent = Agent(store, settings, StubSource(), sample_interval_s=0.5, flush_interval_s=1.0).start()
    try:
        gate = agent.sdk_handler.gate
        assert isinstance(gate, LaneGate) and gate.policy.name == "fair"  # the lane order follows the policy
        assert {"launch", "checkpoint", "stop", "relaunch"} <= set(registered_kinds())
        reply = agent.sdk_handler.handle({"op": "gate", "v": 1, "workflow": "w", "pid": 1, "rank": 0, "lane": "3",
                                          "step": 0, "phase": "begin"})
        assert reply["granted"] is True and gate.snapshot()["3"]["holder"] == ("w", 1, 0)
    finally:
        agent.stop()
        store.dispose()


def test_releasing_a_stopped_job_passes_its_turn_on_at_once() -> None:
    gate = LaneGate("fifo", lease_s=3600)
    gate.begin("1", ("stopped", 1, 0))  # holds the turn, then is stopped by a migration
    done = threading.Event()

    def other() -> None:
        gate.begin("1", ("other", 2, 0), timeout=30)
        done.set()

    t = threading.Thread(target=other)
    t.start()
    wait_queued(gate, "1", 1)
    assert not done.is_set()
    assert gate.release("stopped") == 1
    t.join(timeout=10)
    assert done.is_set() and gate.snapshot()["1"]["holder"] == ("other", 2, 0)


def test_a_job_whose_process_ended_while_it_waited_never_takes_the_turn() -> None:
    gate = LaneGate("pack", lease_s=3600)
    gate.begin("1", ("a", 1, 0))
    replies: list[dict] = []
    # b's request blocks in its connection's thread; then b's process ends (the reaper releases it)
    waiter = threading.Thread(target=lambda: replies.append(
        gate.handle({"lane": "1", "workflow": "b", "pid": 2, "phase": "begin"})), daemon=True)
    waiter.start()
    wait_queued(gate, "1", 1)
    assert gate.release("b") == 1
    waiter.join(timeout=10)
    assert replies and replies[0]["ok"] is False and not replies[0]["granted"]
    # a's next step is a's at once: the dead b is not handed the turn (it would hold it for the whole lease)
    gate.end("1", ("a", 1, 0))
    gate.begin("1", ("a", 1, 0), timeout=5)
    assert gate.snapshot()["1"] == {"holder": ("a", 1, 0), "waiting": [], "turns": 2}
