"""One simulated sweep: a tuner's trials on G GPUs under one trial per GPU (first come, first served: Ray's
default) or under the Fluid allocator, in continuous time with piecewise constant speeds.

A trial progresses at SpeedModel.speed(width) / (seconds per epoch alone) epochs per second. Every start from a
checkpoint costs `restart_s` during which the trial holds its GPUs without progress: a resize, and a resume after a
pause (a promotion of synchronous successive halving, in both modes alike). Under Fluid a trial's seconds per epoch
are unknown until its first epoch ran alone (the profiling step); static mode then pauses it until its group is
measured. The allocator is `enforcer.sweeps.fluid.plan`, the same function the live Ray Tune scheduler calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from enforcer.sim.sweeps.tuners import Release, Tuner
from enforcer.sweeps.fluid import FluidConfig, Kind, TrialState, plan
from enforcer.sweeps.speed import SpeedModel, gpu_cost
from store.errors import InvalidInput

EPS = 1e-9


@dataclass
class SimTrial:
    trial_id: str
    group: str
    config: int
    order: int
    epoch_s: float
    steps_left: float
    queued_at: float = 0.0
    width: float = 0.0
    measured: bool = False
    profile_left: float = 1.0  # epochs until the first measurement
    restart_left: float = 0.0
    started: bool = False  # has a checkpoint: a start is a resume and costs restart_s
    done: bool = False
    work_s: float = 0.0  # epoch-seconds alone of every round it was given


@dataclass(frozen=True)
class Reallocation:
    at: float
    trial_id: str
    kind: str
    old_width: float
    new_width: float
    reason: str = ""


@dataclass
class RunResult:
    makespan: float
    work_s: float  # sum over trials of their rounds' time alone on one GPU
    longest_s: float  # the longest single trial's time alone
    late_util: float  # GPUs held / G over the late rounds (fewer unfinished trials than GPUs)
    reallocations: list[Reallocation] = field(default_factory=list)
    timeline: list[tuple[float, float, float, int]] = field(default_factory=list)  # t0, t1, GPUs held, unfinished


class Engine:
    def __init__(self, tuner: Tuner, gpus: int, speed: SpeedModel, fluid: FluidConfig | None,
                 restart_s: float) -> None:
        if gpus < 1:
            raise InvalidInput(f"a sweep needs at least one GPU, not {gpus}")
        self.tuner, self.gpus, self.speed, self.fluid, self.restart_s = tuner, gpus, speed, fluid, restart_s
        self.trials: dict[str, SimTrial] = {}
        self.now = 0.0
        self.result = RunResult(0.0, 0.0, 0.0, 0.0)

    # ---- trials
    def _release(self, releases: list[Release]) -> None:
        for r in releases:
            t = self.trials.get(r.trial_id)
            if t is None:
                t = SimTrial(r.trial_id, r.group, r.config, len(self.trials),
                             float(self.tuner.table.epoch_s[r.config]), r.steps)
                self.trials[r.trial_id] = t
            else:
                t.group, t.steps_left, t.done = r.group, r.steps, False
            t.queued_at = self.now
            t.work_s += r.steps * t.epoch_s

    def _unfinished(self) -> list[SimTrial]:
        return [t for t in self.trials.values() if not t.done]

    # ---- allocation
    def _start(self, t: SimTrial, width: float, kind: str, reason: str = "") -> None:
        self.result.reallocations.append(Reallocation(self.now, t.trial_id, kind, t.width, width, reason))
        if kind == Kind.RESIZE or t.started:
            t.restart_left = self.restart_s
        t.width, t.started = width, True

    def _allocate(self) -> None:
        waiting = [t for t in self._unfinished() if t.width == 0.0]
        if not waiting and self.fluid is None:
            return
        if self.fluid is None:
            free = self.gpus - gpu_cost([t.width for t in self.trials.values()])
            for t in sorted(waiting, key=lambda t: (t.queued_at, t.order)):
                if free < 1:
                    break
                self._start(t, 1.0, Kind.START)
                free -= 1
            return
        state = [TrialState(t.trial_id, t.group, t.steps_left, t.epoch_s if t.measured else None, t.width,
                            True, t.order) for t in self._unfinished()]
        for d in plan(state, self.fluid):
            if d.changes:
                self._start(self.trials[d.trial_id], d.new_width, d.kind, d.reason)

    # ---- time
    def _boundary(self, t: SimTrial) -> float:
        steps = t.steps_left if t.measured or self.fluid is None else min(t.steps_left, t.profile_left)
        return t.restart_left + steps * t.epoch_s / self.speed.speed(t.width)

    def run(self, limit_events: int = 1_000_000) -> RunResult:
        self._release(self.tuner.start())
        self._allocate()
        for _ in range(limit_events):
            live = self._unfinished()
            if not live:
                break
            running = [t for t in live if t.width > 0.0]
            if not running:
                raise InvalidInput(f"the sweep stalled at {self.now:.0f} s: {len(live)} trials wait and none runs")
            dt = min(self._boundary(t) for t in running)
            self.result.timeline.append((self.now, self.now + dt, float(gpu_cost([t.width for t in running])),
                                         len(live)))
            self.now += dt
            events = []
            for t in sorted(running, key=lambda t: t.order):
                spent = min(dt, t.restart_left)
                t.restart_left -= spent
                steps = (dt - spent) * self.speed.speed(t.width) / t.epoch_s
                t.steps_left -= steps
                if self.fluid is not None and not t.measured:
                    t.profile_left -= steps
                if t.restart_left <= EPS and (t.steps_left <= EPS * max(1.0, t.steps_left + steps)
                                              or (self.fluid is not None and not t.measured
                                                  and t.profile_left <= 1e-9)):
                    events.append(t)
            for t in events:
                if self.fluid is not None and not t.measured and t.profile_left <= 1e-9:
                    t.measured = True
                    if t.steps_left > 1e-9:
                        if not self.fluid.dynamic:
                            t.width = 0.0  # static: paused until its group is measured and filled
                        continue
                t.steps_left = 0.0
                go_on, released = self.tuner.round_done(t.trial_id, len(self._unfinished()))
                if go_on is not None:
                    t.steps_left = go_on
                    t.work_s += go_on * t.epoch_s
                else:
                    t.done, t.width = True, 0.0
                self._release(released)
            if events:
                self._allocate()
        else:
            raise InvalidInput("the sweep did not finish within the event limit")
        self.result.makespan = self.now
        self.result.work_s = sum(t.work_s for t in self.trials.values())
        self.result.longest_s = max(t.work_s for t in self.trials.values())
        self.result.late_util = _late_util(self.result.timeline, self.gpus)
        return self.result


def _late_util(timeline: list[tuple[float, float, float, int]], gpus: int) -> float:
    """GPUs held / G from the last time at least G trials were unfinished to the end; a run with no such tail (its
    trials end together) had no late round leaving GPUs idle, and counts as fully used."""
    last = max((i for i, seg in enumerate(timeline) if seg[3] >= gpus), default=-1)
    late = timeline[last + 1:]
    span = sum(t1 - t0 for t0, t1, _, _ in late)
    if span <= 0:
        return 1.0
    return sum((t1 - t0) * held for t0, t1, held, _ in late) / (span * gpus)
