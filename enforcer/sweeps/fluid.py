"""Fluid (MLSys'21): a sweep's trial widths, water-filled into lanes and across GPUs. Pure: state in, decisions out.

The trials a tuner releases together form a group. A trial's height is its work left: measured seconds per step
alone on one GPU times the steps left in its round. Each measured trial starts at

    w_i = min(max(floor(n * h_i / sum(h)), 1/c), d)

and the widths are then brought to the n GPUs at hand: while they need more, the trial that would finish first
gives up a level (and when every trial is at 1/c, the shortest waits); while GPUs are left, a waiting trial starts,
else the trial that would finish last takes the next level (the public code grows the wrong end). Levels are 1/c ..
1/2 (lanes on one GPU; for c > 3 only 1/c and 1/(c-1), `SpeedModel.levels`) and 1 .. d (data-parallel);
`SpeedModel` says how fast each runs.

- A trial with no measurement (or a height of zero) first runs one step alone, on a whole GPU, to get one.
- Static mode fills a group once: when all its trials are measured, then never resizes a running trial. Dynamic
  mode re-fills every released trial whenever one is promoted, paused or stopped.
- A resize restarts the trial from its checkpoint (restart_s). A resize whose best possible gain is below that
  cost is skipped: a growth gains at most the trial's own time saved; a shrink at most the largest gain of what it
  makes room for (a waiting trial starts at most as early as the soonest running trial would have freed a GPU), less
  the time the shrunk trial loses by running narrower.
- A running trial without a checkpoint is never resized; it keeps its resources and the decision says why.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

from enforcer.sweeps.speed import SpeedModel, gpu_cost
from store.errors import InvalidInput
from store.settings import Settings


class Kind(StrEnum):
    PROFILE = "profile"  # starts alone on one GPU to be measured
    START = "start"  # starts (or resumes) at its width
    RESIZE = "resize"  # running: restarted from its checkpoint at a new width
    KEEP = "keep"  # running: keeps its width, for the reason given
    WAIT = "wait"  # not running: waits, for the reason given


def check_steps(trial_id: str, steps: float) -> None:
    """Refuse steps left that are no number of steps >= 0, as a trial reports them: NaN read as none left (max(0, NaN)
    is 0), and so did a negative count, which no round has (a trial's miscount, not an overrun): the trial was taken
    to have ended its round, and kept the GPUs it held without any word."""
    if not math.isfinite(steps) or steps < 0.0:
        raise InvalidInput(f"trial {trial_id!r} reports {steps!r} steps left; report the steps left in its round, "
                           "a number >= 0")


def check_width(trial_id: str, width: float) -> None:
    """Refuse a width that is no number of GPUs >= 0 (0: holds nothing)."""
    if not math.isfinite(width) or width < 0.0:
        raise InvalidInput(f"trial {trial_id!r}: width {width!r} is not a number of GPUs >= 0")


@dataclass(frozen=True)
class TrialState:
    """One released, unfinished trial as the allocator sees it."""

    trial_id: str
    group: str
    remaining_steps: float
    step_s: float | None = None  # measured seconds per step alone on one GPU; None: not measured
    width: float = 0.0  # what it holds now; 0: waiting or paused
    checkpointed: bool = True
    order: int = 0  # release order

    def __post_init__(self) -> None:
        # NaN would read as "no steps left" (max(0, NaN) is 0) or "not running" (NaN > 0 is false): a trial ended
        # or GPUs counted free without anyone saying so. Below 0 (the simulator's rounding, a hair under) is none left;
        # what a trial reports is refused below 0 before it gets here (check_steps, in the controller).
        if not math.isfinite(self.remaining_steps):
            raise InvalidInput(f"trial {self.trial_id!r}: steps left {self.remaining_steps!r} is not a number of "
                               "steps; report the steps left in its round")
        check_width(self.trial_id, self.width)

    @property
    def measured(self) -> bool:
        return self.step_s is not None and math.isfinite(self.step_s) and self.step_s > 0.0

    @property
    def height(self) -> float:
        return (self.step_s or 0.0) * max(0.0, self.remaining_steps)

    @property
    def running(self) -> bool:
        return self.width > 0.0


@dataclass(frozen=True)
class Decision:
    trial_id: str
    kind: Kind
    old_width: float
    new_width: float
    reason: str = ""
    gain_s: float = 0.0  # a resize's best possible gain (seconds), which beat its restart cost

    @property
    def changes(self) -> bool:
        return self.kind in (Kind.PROFILE, Kind.START, Kind.RESIZE)


@dataclass(frozen=True)
class FluidConfig:
    gpus: int  # n
    speed: SpeedModel
    dynamic: bool = True
    restart_s: float = 10.0
    skip_unprofitable: bool = True

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise InvalidInput(f"a sweep needs at least one GPU, not {self.gpus}")
        if self.restart_s < 0:
            raise InvalidInput(f"restart cost {self.restart_s} s is negative")


def config_from_settings(settings: Settings, gpus: int, share_speeds: tuple[float, ...] = (1.0, 0.65)
                         ) -> FluidConfig:
    """A FluidConfig from the settings (c, d, eta, restart cost, mode); `share_speeds` from `speed.from_lucid`
    (cut to c)."""
    speeds = share_speeds[: settings.sweep_max_share] or (1.0,)
    speed = SpeedModel(settings.sweep_dp_efficiency, tuple(speeds), settings.sweep_max_span)
    return FluidConfig(gpus, speed, dynamic=settings.sweep_dynamic, restart_s=settings.sweep_restart_s)


def fill(heights: dict[str, float], budget: int, speed: SpeedModel, *, must_run: Iterable[str] = (),
         order: dict[str, int] | None = None) -> dict[str, float]:
    """Widths of measured trials (height > 0) on `budget` GPUs; 0 for a trial that must wait. Deterministic."""
    if not heights:
        return {}
    levels = speed.levels()
    index = {lvl: i for i, lvl in enumerate(levels)}
    rank = order or {}
    keep = set(must_run)
    total = sum(heights.values())
    c_min, d = levels[0], float(speed.max_span)

    def tiebreak(t: str) -> tuple[int, str]:
        return (rank.get(t, 0), t)

    def finish(t: str, w: float) -> float:
        return heights[t] / speed.speed(w)

    width: dict[str, float] = {}
    for t in sorted(heights, key=tiebreak):
        raw = budget * heights[t] / total
        w = min(max(float(math.floor(raw)), c_min), d)
        width[t] = w if w in index else max(lvl for lvl in levels if lvl <= w)
    while gpu_cost(list(width.values())) > budget:
        shrinkable = [t for t in width if index[width[t]] > 0]
        if shrinkable:
            t = min(shrinkable, key=lambda t: (finish(t, width[t]), tiebreak(t)))
            width[t] = levels[index[width[t]] - 1]
            continue
        droppable = [t for t in width if t not in keep]
        if not droppable:
            break  # the trials that must run already exceed the budget: the caller pinned more than it has
        del width[min(droppable, key=lambda t: (heights[t], -rank.get(t, 0), t))]  # the shortest, latest waits
    for t in sorted((t for t in heights if t not in width), key=lambda t: (-heights[t], tiebreak(t))):
        width[t] = c_min
        if gpu_cost(list(width.values())) > budget:
            del width[t]
            break
    grew = True
    while grew:
        grew = False
        for t in sorted(width, key=lambda t: (-finish(t, width[t]), tiebreak(t))):
            i = index[width[t]]
            if i + 1 >= len(levels) or speed.speed(levels[i + 1]) <= speed.speed(width[t]):
                continue
            width[t] = levels[i + 1]
            if gpu_cost(list(width.values())) <= budget:
                grew = True
                break
            width[t] = levels[i]
    return {t: width.get(t, 0.0) for t in heights}


def plan(trials: Sequence[TrialState], config: FluidConfig) -> list[Decision]:
    """What every released trial does next: one decision per trial that changes or is held back, in release order."""
    speed, n = config.speed, config.gpus
    by_id = {t.trial_id: t for t in trials}
    if len(by_id) != len(trials):
        raise InvalidInput("a trial appears twice in one sweep's state")
    order = {t.trial_id: t.order for t in trials}
    notes: dict[str, str] = {}
    pinned: dict[str, float] = {}
    for t in trials:
        if not t.running:
            continue
        if t.measured and t.height <= 0.0:
            pinned[t.trial_id] = t.width  # its last step is done: it ends with what it holds
        elif not t.measured:
            pinned[t.trial_id] = t.width
            notes[t.trial_id] = "" if t.step_s is None else f"height {t.step_s!r} is no measurement; profiling"
        elif not config.dynamic:
            pinned[t.trial_id] = t.width
        elif not t.checkpointed:
            pinned[t.trial_id] = t.width
            notes[t.trial_id] = "no checkpoint: never resized, keeps its resources"
    groups_unmeasured = {t.group for t in trials if not t.measured}
    while True:
        free = n - gpu_cost(list(pinned.values()))
        running_free = [t for t in trials if t.running and t.trial_id not in pinned]
        need_running = gpu_cost([speed.levels()[0]] * len(running_free))
        profiles: list[str] = []
        for t in sorted((t for t in trials if not t.running and not t.measured), key=lambda t: (t.order, t.trial_id)):
            if free - need_running - len(profiles) >= 1:
                profiles.append(t.trial_id)
        candidates = {t.trial_id: t.height for t in trials
                      if t.measured and t.height > 0.0 and t.trial_id not in pinned}
        if not config.dynamic:  # static: a group is filled once all of it is measured
            for t in trials:
                if not t.running and t.measured and t.group in groups_unmeasured:
                    candidates.pop(t.trial_id, None)
                    notes[t.trial_id] = "static: the group is filled once all its trials are measured"
        target = fill(candidates, max(0, free - len(profiles)), speed,
                      must_run=[t.trial_id for t in running_free], order=order)
        skipped = (_unprofitable(trials, target, config, bool(profiles))
                   if config.dynamic and config.skip_unprofitable else {})
        if not skipped:
            break
        for tid, reason in skipped.items():
            pinned[tid] = by_id[tid].width
            notes[tid] = reason
    decisions: list[Decision] = []
    for t in sorted(trials, key=lambda t: (t.order, t.trial_id)):
        tid = t.trial_id
        if tid in profiles:
            decisions.append(Decision(tid, Kind.PROFILE, t.width, 1.0, notes.get(tid) or "no measurement yet: "
                                      "one step alone on a whole GPU"))
        elif tid in pinned:
            if notes.get(tid):
                decisions.append(Decision(tid, Kind.KEEP, t.width, t.width, notes[tid]))
        elif target.get(tid, 0.0) > 0.0:
            w = target[tid]
            if not t.running:
                decisions.append(Decision(tid, Kind.START, 0.0, w, "water-filled"))
            elif abs(w - t.width) > 1e-9:
                decisions.append(Decision(tid, Kind.RESIZE, t.width, w, "re-filled",
                                          _gains(trials, target, config, bool(profiles)).get(tid, 0.0)))
        elif not t.running:
            decisions.append(Decision(tid, Kind.WAIT, 0.0, 0.0, notes.get(tid) or (
                "no measurement yet and no whole GPU free" if not t.measured
                else "no steps left in its round" if t.height <= 0.0
                else "the group is larger than the fleet: waits for a GPU")))
    return decisions


def _gains(trials: Sequence[TrialState], target: dict[str, float], config: FluidConfig,
           profiling: bool) -> dict[str, float]:
    """Each resize's best possible gain in seconds (see the module's doc)."""
    speed = config.speed
    running = [t for t in trials if t.running]
    soonest = min((t.height / speed.speed(t.width) for t in running if t.measured), default=0.0)
    grow: dict[str, float] = {}
    shrink: list[str] = []
    benefit = 0.0
    for t in running:
        w = target.get(t.trial_id)
        if w is None or abs(w - t.width) <= 1e-9 or not t.measured:
            continue
        if w > t.width:
            grow[t.trial_id] = t.height / speed.speed(t.width) - t.height / speed.speed(w)
            benefit = max(benefit, grow[t.trial_id])
        else:
            shrink.append(t.trial_id)
    if profiling or any(not t.running and target.get(t.trial_id, 0.0) > 0.0 for t in trials):
        benefit = max(benefit, soonest)
    by_id = {t.trial_id: t for t in running}
    # a shrink's best gain: what it makes room for, less the time the shrunk trial itself loses
    loss = {tid: by_id[tid].height * (1.0 / speed.speed(target[tid]) - 1.0 / speed.speed(by_id[tid].width))
            for tid in shrink}
    return {**grow, **{tid: benefit - loss[tid] for tid in shrink}}


def _unprofitable(trials: Sequence[TrialState], target: dict[str, float], config: FluidConfig,
                  profiling: bool) -> dict[str, str]:
    """The resizes whose best possible gain is below the restart cost, each with the reason it is skipped."""
    return {tid: f"resize skipped: best gain {gain:.1f} s < restart {config.restart_s:.1f} s"
            for tid, gain in _gains(trials, target, config, profiling).items() if gain < config.restart_s}


def apply(trials: Sequence[TrialState], decisions: Iterable[Decision]) -> list[TrialState]:
    """The trials with the decisions' widths (what the simulator and the tests step through)."""
    new = {d.trial_id: d.new_width for d in decisions if d.changes}
    return [replace(t, width=new.get(t.trial_id, t.width)) for t in trials]
