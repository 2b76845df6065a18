"""Tiresias's two-dimensional least-attained-service baseline (NSDI'19), simulator only.

A job's service is devices x seconds it has run (2D). Jobs sit in priority queues by service (thresholds in
device-seconds); a lower queue always goes first, arrival order inside a queue. At every event the scheduler
lets jobs run in that order while devices last, preempting running jobs of lower priority; a preempted job
checkpoints and pays the migration cost when it starts again (Simulation.migration_cost_s). Jobs get whole
devices (Tiresias schedules whole-GPU jobs; a fractional request is rounded up to one device). Placement is the
enforcer's FIFO policy (first empty devices, a multi-device job on one host). Not modelled: Tiresias's
starvation guard (promotion after waiting too long) and its skew-aware placement.
"""

from __future__ import annotations

import bisect
from typing import ClassVar

from enforcer.discipline import JOB_ORDER
from enforcer.lanes import Job
from enforcer.policies.fifo import Fifo

DEFAULT_THRESHOLDS = (3600.0, 36000.0)  # device-seconds: three queues


class TiresiasPolicy(Fifo):
    """Whole devices, ordered by 2D-LAS queue then arrival.

    Not in enforcer.policies' registry: it is a simulator baseline, which enforcer.sim.adapter.make_policy names.
    """

    name: ClassVar[str] = "tiresias"
    description: ClassVar[str] = "simulator baseline: 2D least attained service queues, whole devices, preemptive"
    thresholds: tuple[float, ...] = DEFAULT_THRESHOLDS

    def priority(self, job: Job) -> tuple[float, ...]:
        return (float(bisect.bisect_right(self.thresholds, job.attained_s)),)



class TiresiasScheduler:
    """Drives the Simulation itself: decides the whole running set at every event (preemptive)."""

    lane_discipline = JOB_ORDER
    exclusive = True
    preemptive = True

    def __init__(self, thresholds: tuple[float, ...] = DEFAULT_THRESHOLDS, **_: object) -> None:
        self.policy = TiresiasPolicy()
        self.policy.thresholds = tuple(sorted(thresholds))
        self.name = "tiresias"
        self._wake: float | None = None

    def priority(self, job: Job) -> tuple:
        return self.policy.priority(job)

    def pick_next(self, jobs: list[Job]) -> Job | None:
        return self.policy.pick_next(jobs)

    def queue_order(self, waiting: list) -> list:
        return sorted(waiting, key=lambda s: (*self.policy.priority(s.job), s.sim.arrival, s.idx))

    def schedule(self, sim, t: float) -> set[int]:
        touched: set[int] = set()
        for js in sim.running.values():  # bring service up to date: it decides the queues
            sim._advance(js, t)
        order = self.queue_order(list(sim.running.values()) + list(sim.waiting.values()))
        budget = len(sim.fleet.devices)
        keep: set[int] = set()
        for js in order:
            if js.job.gpus <= budget:
                keep.add(js.idx)
                budget -= js.job.gpus
        for js in [s for s in sim.running.values() if s.idx not in keep]:
            touched.update(sim.preempt(js, t))
        for js in order:
            if js.idx in keep and js.state == 0:
                placed = self.policy.place(js.job, sim.fleet)
                if placed:
                    touched.update(sim.start(js, placed, t))
        # wake up when a running job crosses into the next queue: the order may change then
        earliest = None
        for js in sim.running.values():
            level = int(self.policy.priority(js.job)[0])
            if level < len(self.policy.thresholds):
                at = t + max((self.policy.thresholds[level] - js.attained) / js.job.gpus, 1e-6)
                earliest = at if earliest is None else min(earliest, at)
        # one pending wake-up at a time, or every event would queue one per running job
        if earliest is not None and (self._wake is None or self._wake <= t or earliest < self._wake - 1e-9):
            sim.push(earliest, 2, -1)
            self._wake = earliest
        return touched
