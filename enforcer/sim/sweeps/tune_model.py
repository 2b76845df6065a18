"""The simulator's model of Ray Tune running a sweep under the Fluid scheduler: the same `SweepController` the live
scheduler (collector.tune) drives, on simulated time.

As Ray Tune does: every trial starts at the base width (one GPU); pending trials start first, in order, then paused
ones, each once its placement group fits; a trial reports after every step. As the live scheduler does at Ray's
`choose_trial_to_run`: the controller counts every pending trial from the start (`pending`), a paused trial whose
growth was handed out resumes first, and another paused trial only when the controller lets it (`may_start`). A
placement group (one bundle) goes on the GPUs as Ray's raylet puts it (`place`), and stays there until the trial
stops. The controller learns that a trial runs, at which width and on which GPUs, from its results (as the live
scheduler does); on a result that continues it may hand the trial a new width, and the trial is paused and restarted
from its checkpoint with it (costing `restart_s`); its final result stops it without a reallocation; GPUs it frees
reach the others at their next result. A trial that dies in a step (`fail_at`) loses that step, gives its GPUs back
and is retried once, last in the queue, from its checkpoint with the placement group it held (Ray does not reset
it).
"""

from __future__ import annotations

from dataclasses import dataclass

from enforcer.sweeps.controller import SweepController
from enforcer.sweeps.fluid import FluidConfig
from store.errors import InvalidInput

EPS = 1e-6


@dataclass
class _Trial:
    trial_id: str
    step_s: float
    steps: int
    done: int = 0
    width: float = 0.0  # the placement group it holds (running) or waits for (pending/paused)
    state: str = "pending"
    next_at: float = 0.0  # when it reports next (running)
    gpus: tuple[int, ...] = ()  # where its placement group sits (running)
    failed: bool = False


def place(free: list[float], width: float) -> tuple[int, ...] | None:
    """Where Ray puts a bundle of `width` GPUs on a node whose GPUs have `free` left (NodeResourceInstanceSet::
    TryAllocate): a whole number takes the first GPUs that hold nothing; a fraction the GPU it fits most tightly, the
    first of equals; None when it does not fit. Updates `free`."""
    if width >= 1.0 - EPS:
        idle = [i for i, f in enumerate(free) if f >= 1.0 - EPS][:round(width)]
        if len(idle) < round(width):
            return None
        for i in idle:
            free[i] = 0.0
        return tuple(idle)
    fits = [i for i, f in enumerate(free) if f >= width - EPS]
    if not fits:
        return None
    best = min(fits, key=lambda i: (free[i] - width, i))
    free[best] -= width
    return (best,)


def release(free: list[float], width: float, gpus: tuple[int, ...]) -> None:
    for i in gpus:
        free[i] += 1.0 if width >= 1.0 - EPS else width


def run_tune_model(trials: list[tuple[str, float, int]], config: FluidConfig, *,
                   start_s: float | dict[str, float] = 0.0,
                   restart_s: float | None = None, base_width: float = 1.0,
                   max_t: int | None = None, fail_at: dict[str, int] | None = None) -> SweepController:
    """Simulate (trial id, seconds per step alone, steps) trials; return the controller with its reallocation log.
    `start_s`: a trial's start-up time (one for all, or per trial); `restart_s`: a restart's (default: the config's).

    `max_t`: the base scheduler stops a trial at that many steps (its last result never reaches the allocation
    function); a trial that ends earlier on its own reports its last result to it first, as Ray Tune does.
    `fail_at`: a trial dies once, in that step (0: its first), and is retried."""
    if not trials:
        raise InvalidInput("a sweep needs at least one trial")
    restart = config.restart_s if restart_s is None else restart_s
    ctrl = SweepController(config, base_width)
    model = [_Trial(tid, s, n, width=base_width) for tid, s, n in trials]
    for t in model:
        ctrl.add(t.trial_id, "sweep", t.steps)
    fail = fail_at or {}
    free = [1.0] * config.gpus
    now = 0.0
    for _ in range(100_000):
        pending = [t for t in model if t.state == "pending"]
        for t in pending:
            ctrl.pending(t.trial_id, t.width)
        idle = not any(t.state == "running" for t in model)
        paused = sorted((t for t in model if t.state == "paused"), key=lambda t: t.trial_id not in ctrl.promised)
        for t in pending + paused:
            if (t.state == "paused" and t.trial_id not in ctrl.promised
                    and not ctrl.may_start(t.trial_id, t.width, idle=idle)):
                continue
            gpus = place(free, t.width)
            if gpus is not None:
                ctrl.growth_placed(t.trial_id)
                first = start_s.get(t.trial_id, 0.0) if isinstance(start_s, dict) else start_s
                busy = first if t.state == "pending" and not t.failed else restart
                t.next_at = now + busy + t.step_s / config.speed.speed(t.width)
                t.state, t.gpus = "running", gpus
        running = [t for t in model if t.state == "running"]
        if not running:
            if any(t.state != "done" for t in model):
                raise InvalidInput("the modelled sweep stalled: trials wait and none runs")
            return ctrl
        now = min(t.next_at for t in running)
        for t in sorted((t for t in running if t.next_at - now <= 1e-9), key=lambda t: t.trial_id):
            if fail.get(t.trial_id) == t.done and not t.failed:  # dies in this step: retried at what it held
                t.failed, t.state = True, "pending"
                release(free, t.width, t.gpus)
                ctrl.finished(t.trial_id, "died: its GPUs went back to the sweep", died=True, now=now)
                ctrl.retried(t.trial_id, "sweep", t.width, now=now)
                model.remove(t)
                model.append(t)
                continue
            t.done += 1
            ctrl.running(t.trial_id, t.width, [f"gpu{i}" for i in t.gpus], now=now)
            if t.done >= t.steps:
                if max_t is None or t.done < max_t:
                    ctrl.on_result(t.trial_id, t.step_s, 0.0, now=now)
                t.state = "done"
                release(free, t.width, t.gpus)
                ctrl.finished(t.trial_id)
                continue
            width = ctrl.on_result(t.trial_id, t.step_s, t.steps - t.done, now=now)
            if abs(width - t.width) > 1e-9:
                release(free, t.width, t.gpus)
                t.width, t.state = width, "paused"
            else:
                t.next_at = now + t.step_s / config.speed.speed(t.width)
    raise InvalidInput("the modelled sweep did not finish")
