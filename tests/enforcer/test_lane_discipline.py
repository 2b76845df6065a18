"""One lane discipline: the same jobs through the live lane gate (real threads, real waits) and through the
simulator's step order take their steps in the same order, under every policy."""

from __future__ import annotations

import threading
import time

import pytest

from enforcer.discipline import (
    JOB_ORDER,
    LEAST_ATTAINED,
    LEAST_REMAINING,
    ROUND_ROBIN,
    StepJob,
    Turn,
    next_turn,
    shares,
    step_order,
)
from enforcer.gate import LaneGate
from enforcer.policies import kind_of
from enforcer.sim.adapter import make_policy

# (name, steps, seconds per step): step times far enough apart that timing noise cannot flip a comparison
JOBS = [("a", 3, 0.1), ("b", 2, 0.01), ("c", 2, 0.03)]


def live_order(policy: str) -> list[str]:
    totals = {name: steps for name, steps, _ in JOBS}
    gate = LaneGate(policy, total_steps=totals.get, reserve_s=2.0, lease_s=30.0)
    order: list[str] = []
    lock = threading.Lock()
    everyone_waits = threading.Event()

    def job(name: str, steps: int, step_s: float) -> None:
        key = (name, 1, 0)
        for step in range(steps):
            gate.begin("lane", key, step, timeout=30)
            with lock:
                order.append(name)
            if name == "a" and step == 0:
                assert everyone_waits.wait(10)  # the others ask while a's first step runs
            time.sleep(step_s)
            gate.end("lane", key)
        gate.leave(key)

    threads = [threading.Thread(target=job, args=j) for j in JOBS]
    threads[0].start()
    for k, t in enumerate(threads[1:], start=1):
        t.start()
        deadline = time.monotonic() + 10
        while len(gate.snapshot().get("lane", {}).get("waiting", [])) < k:
            assert time.monotonic() < deadline, "a job never came to wait for the lane"
            time.sleep(0.005)
    everyone_waits.set()
    for t in threads:
        t.join(30)
        assert not t.is_alive()
    return order


def simulated_order(policy: str) -> list[str]:
    # b and c come to the lane while a's first step runs, in that order
    jobs = [StepJob(name, 0.001 * k, steps, step_s) for k, (name, steps, step_s) in enumerate(JOBS)]
    return step_order(kind_of(policy), jobs)  # the policy's own lane order


@pytest.mark.parametrize("policy", ["fifo", "pack", "fair", "srtf"])
def test_live_gate_and_simulator_take_steps_in_the_same_order(policy: str):
    expected = simulated_order(policy)
    assert sorted(expected) == sorted(name for name, steps, _ in JOBS for _ in range(steps))
    assert live_order(policy) == expected


def test_the_disciplines_differ_where_they_should():
    orders = {p: simulated_order(p) for p in ("fifo", "pack", "fair", "srtf")}
    assert orders["fifo"] == ["a"] * 3 + ["b"] * 2 + ["c"] * 2  # the first job to completion, then the next
    assert orders["pack"][:4] == ["a", "b", "c", "a"]  # round robin
    # remaining time is steps left x measured step time: b and c, which declared their steps, each take one step
    # to be measured (b first: it came first); then the least remaining goes: b (0.01 s), c (0.03 s), a (0.2 s)
    assert orders["srtf"] == list("abcbcaa")
    assert orders["fair"] == list("abcbcaa") and orders["pack"] == list("abcabca")


def test_simulator_engine_uses_the_same_discipline():
    assert make_policy("fifo").lane_discipline == JOB_ORDER
    assert make_policy("pack").lane_discipline == ROUND_ROBIN
    assert make_policy("fair").lane_discipline == LEAST_ATTAINED
    assert make_policy("srtf").lane_discipline == LEAST_REMAINING
    turns = [Turn("x", 0.0, 5.0, 3.0, 10.0), Turn("y", 1.0, 2.0, 1.0, 20.0)]
    assert shares(ROUND_ROBIN, turns) == {"x": 0.5, "y": 0.5}
    assert shares(JOB_ORDER, turns) == {"x": 1.0}
    assert shares(LEAST_REMAINING, turns) == {"x": 1.0}
    assert shares(LEAST_ATTAINED, turns) == {"y": 1.0}
    assert next_turn(ROUND_ROBIN, turns).key == "y"  # asked first


def test_srtf_lets_a_short_newcomer_through_live_and_simulated():
    """A 1-step job coming to a lane a 10-step job holds goes next (after one step of the long one), live and in
    the step order; it used to wait for all ten: a newcomer's remaining time was unknown until it ran a step, so
    the job with a known time always went first and SRTF was FIFO."""
    simulated = step_order(LEAST_REMAINING, [StepJob("long", 0.0, 10, 1.0), StepJob("short", 0.5, 1, 1.0)])
    assert simulated == ["long", "short"] + ["long"] * 9
    gate = LaneGate("srtf", total_steps={"long": 10, "short": 1}.get, reserve_s=2.0, lease_s=30.0)
    order: list[str] = []
    first_step = threading.Event()

    def job(name: str, steps: int) -> None:
        key = (name, 1, 0)
        for step in range(steps):
            gate.begin("lane", key, step, timeout=30)
            order.append(name)
            if name == "long" and step == 0:
                assert first_step.wait(10)  # short asks while long's first step runs
            time.sleep(0.005)
            gate.end("lane", key)
        gate.leave(key)

    long_job = threading.Thread(target=job, args=("long", 10))
    long_job.start()
    while not gate.snapshot().get("lane", {}).get("holder"):
        time.sleep(0.002)
    short_job = threading.Thread(target=job, args=("short", 1))
    short_job.start()
    deadline = time.monotonic() + 10
    while not gate.snapshot()["lane"]["waiting"]:
        assert time.monotonic() < deadline, "short never came to wait for the lane"
        time.sleep(0.002)
    first_step.set()
    for t in (long_job, short_job):
        t.join(30)
        assert not t.is_alive()
    assert order == simulated


def test_srtf_a_job_without_declared_steps_goes_after_those_with_a_time():
    measured = Turn("m", 0.0, 0.0, remaining_s=50.0)
    newcomer = Turn("n", 1.0, 1.0, probe=True)  # declared its steps, none measured yet
    undeclared = Turn("u", -1.0, -1.0)  # no steps declared: no remaining time, ever
    assert next_turn(LEAST_REMAINING, [measured, newcomer, undeclared]).key == "n"
    assert next_turn(LEAST_REMAINING, [measured, undeclared]).key == "m"
    assert shares(LEAST_REMAINING, [undeclared, measured]) == {"m": 1.0}
