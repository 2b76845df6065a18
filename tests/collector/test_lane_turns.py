"""A lane turn on the job's side, on the CPU with the real SDK, socket and gate: a step whose device work outlasts
the gate's lease keeps its turn (the SDK renews it while the step's waiter is pending), and a loop left with
`break` gives its turn up at once rather than at the lease."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from collector.job import job
from enforcer.gate import LaneGate
from store.settings import get_settings
from tests.collector.test_job_sdk import Served


@pytest.fixture
def served(fleet_home: Path) -> Iterator[Served]:
    agent = Served(get_settings(fresh=True))
    yield agent
    agent.stop()
    agent.store.dispose()


def test_a_step_longer_than_the_lease_keeps_its_turn_while_its_work_is_pending(served: Served) -> None:
    served.handlers.gate = gate = LaneGate("pack", lease_s=0.4)
    spans: dict[str, list[tuple[float, float]]] = {"long-a": [], "long-b": []}
    renewals: dict[str, int] = {}
    errors: list[BaseException] = []
    lane = served.settings.model_copy(update={"lane": "9"})

    def run(name: str) -> None:
        def device_work() -> None:  # the step's kernels, still running for 1.2 s (3 leases) after Python returned
            time.sleep(1.2)
            spans[name][-1] = (spans[name][-1][0], time.monotonic())

        try:
            with job(name, total_steps=3, workflow=name, settings=lane, step_done=device_work) as j:
                for _ in j.steps():
                    spans[name].append((time.monotonic(), float("inf")))
                renewals[name] = getattr(j, "renewals", 0)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(name,)) for name in spans]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and all(len(s) == 3 for s in spans.values()), (errors, spans)
    a, b = spans["long-a"], spans["long-b"]
    # a step runs from its turn's grant until its device work is done: no two lane-mates' steps ever overlap
    overlaps = [(x, y) for x in a for y in b if x[0] < y[1] and y[0] < x[1]]
    assert overlaps == [], overlaps
    assert min(renewals.values()) >= 3  # each job renewed its lease while its first step's work was pending
    assert gate.snapshot()["9"]["turns"] >= 6


def test_a_loop_left_with_break_gives_its_turn_up_at_once(served: Served) -> None:
    served.handlers.gate = LaneGate("pack", lease_s=10.0)
    lane = served.settings.model_copy(update={"lane": "4"})
    left, granted = threading.Event(), {}

    def leaver() -> None:
        with job("leaver", total_steps=100, workflow="leaver", settings=lane) as j:
            for _ in j.steps():
                break  # e.g. early stopping: the job goes on with other work, outside the lane's turns
            left.set()
            time.sleep(6.0)  # evaluation, saving...: still alive, still connected, no longer stepping

    def mate() -> None:
        left.wait(30)
        asked = time.monotonic()
        with job("mate", total_steps=2, workflow="mate", settings=lane) as j:
            for _ in j.steps():
                granted.setdefault("first", time.monotonic() - asked)

    threads = [threading.Thread(target=leaver), threading.Thread(target=mate)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert "first" in granted
    assert granted["first"] < 3.0, f"the lane-mate waited {granted['first']:.1f} s for a turn nobody used"


def test_the_turn_taken_for_data_that_ran_out_passes_on_at_once(served: Served) -> None:
    # in a lane the turn is taken before the loader is asked (a batch it puts on the GPU is within the turn's cap):
    # when the data has run out, that turn must not stay with a job that has gone on to evaluate
    served.handlers.gate = LaneGate("pack", lease_s=10.0)
    lane = served.settings.model_copy(update={"lane": "5"})
    done_epoch, granted = threading.Event(), {}

    def epoch() -> None:
        with job("epoch", workflow="epoch", settings=lane) as j:
            assert list(j.steps(["a", "b", "c"])) == ["a", "b", "c"]
            done_epoch.set()
            time.sleep(6.0)  # evaluation after the epoch: no steps, still connected

    def mate() -> None:
        done_epoch.wait(30)
        asked = time.monotonic()
        with job("mate", total_steps=2, workflow="mate", settings=lane) as j:
            for _ in j.steps():
                granted.setdefault("first", time.monotonic() - asked)

    threads = [threading.Thread(target=epoch), threading.Thread(target=mate)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert granted.get("first", 99.0) < 3.0, granted
