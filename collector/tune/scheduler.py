"""A Ray Tune scheduler that sizes trials with Fluid: ASHA, HyperBand or synchronous successive halving decide which
trials go on, and `enforcer.sweeps.controller.SweepController` decides how many GPUs each one gets.

It runs in the tuner's driver process, as the job SDK runs inside a training job. Ray Tune's rules, which it keeps:
every trial starts with the same resources (one GPU, the profiling step) and is sized after its first result; the
allocation function runs only when the base scheduler lets a trial continue, and GPUs freed by a stop reach the
others at their next result; every change restarts the trial from its checkpoint, so `reuse_actors=False`; a
function trainable sees only the first bundle, so the placement group is one {"GPU": width} bundle (read it with
`tune.get_context().get_trial_resources()`); the allocation function is an object, never a bound method. A sweep's
trials form one group: its Ray Tune experiment (`sweep_of`).

A trial reports `fleetlens_step_s` (its seconds per step alone on one GPU, as the SDK measured and normalised it)
and `fleetlens_steps_left` (steps left in its round) with each result, and should report `fleetlens_gpu_ids`
(`ray.get_gpu_ids()`): Ray keeps a fractional bundle on the GPU it placed it on, so the controller counts GPUs shared
by trials that said where they are once, and any other share as a GPU of its own (a growth then waits longer). The
controller learns the width a trial runs at from its placement group at every result, and the width Ray retries a
trial that died at (its last placement group: Ray does not reset it).

Between results Ray starts trials too: at every step of its loop (TuneController._maybe_add_actors) it asks
`choose_trial_to_run` which trial to start or resume, then requests a placement group for every PENDING trial itself,
whatever the answer; a PAUSED trial (one paused to resize, or by HyperBand) resumes only once that answer names it. A
trial the base scheduler pauses (HyperBand at its rung) holds nothing meanwhile (Ray frees its placement group): the
others may grow into its GPUs from their next result, and it is counted again once it is chosen. So every PENDING
trial is counted at its placement group's width from the step Ray has it, and the trial chosen is counted before Ray
stages it; a growth handed out and not placed yet goes first (ASHA's FIFO order would put it behind every PENDING
trial), and another trial that would take the GPUs it was promised is answered None until it is placed (Ray runs it
again) or given up, unless nothing runs. Every reallocation is kept in `log` in order; every event (start, resize,
keep with its reason, wait (a pause too), finish, died) is handed to `on_event` (`StoreRecorder` writes them to the
store). Ray stops the trials of an experiment stopped as a whole (a Stopper's stop_all, time_budget_s, fail_fast)
without telling the scheduler: the run's callback `ending()` ends them with the experiment. The scheduler adds that
callback to the run itself when its first trial is added, unless the run already has it, so a run configured without
it still ends its records; where Ray's controller does not let it (another Ray release), it logs that the run needs
`callbacks=[scheduler.ending()]`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from ray.tune import Callback
from ray.tune.execution.placement_groups import PlacementGroupFactory
from ray.tune.experiment import Trial
from ray.tune.result import SHOULD_CHECKPOINT
from ray.tune.schedulers import (
    AsyncHyperBandScheduler,
    HyperBandScheduler,
    ResourceChangingScheduler,
    TrialScheduler,
)

from enforcer.sweeps.controller import Event, Reallocation, SweepController
from enforcer.sweeps.fluid import FluidConfig
from store.db import Store
from store.errors import InvalidInput
from store.sweeps import record_event, record_sweep

log = logging.getLogger(__name__)

STEP_S = "fleetlens_step_s"
STEPS_LEFT = "fleetlens_steps_left"
GPU_IDS = "fleetlens_gpu_ids"
BASES = ("asha", "hyperband", "sha")


def bundle(width: float, cpu: float) -> PlacementGroupFactory:
    """One bundle: a function trainable sees only the first."""
    return PlacementGroupFactory([{"CPU": cpu, "GPU": width}])


def gpus_of(resources: PlacementGroupFactory | None) -> float:
    """The GPUs a placement group factory asks for."""
    return 0.0 if resources is None else float(resources.required_resources.get("GPU", 0.0))


def sweep_of(trial: Any) -> str:
    """The group a trial belongs to: its Ray Tune experiment (the directory name every trial of one Tuner run shares,
    a restored run too). Not `experiment_tag`: Ray makes that per trial ("0_lr=0.1")."""
    name = getattr(getattr(trial, "storage", None), "experiment_dir_name", None)
    if not name:
        raise InvalidInput(f"trial {trial.trial_id} has no Ray Tune experiment (trial.storage.experiment_dir_name): "
                           "Fluid cannot group it into its sweep")
    return str(name)


def base_scheduler(name: str, *, metric: str, mode: str, max_t: int, grace_period: int = 1,
                   reduction_factor: int = 3) -> TrialScheduler:
    """ASHA, or HyperBand / synchronous successive halving: Ray's HyperBandScheduler, whose brackets are each a
    synchronous successive halving (Ray has no single-bracket scheduler, so "sha" names the same class)."""
    if name == "asha":
        return AsyncHyperBandScheduler(time_attr="training_iteration", metric=metric, mode=mode, max_t=max_t,
                                       grace_period=grace_period, reduction_factor=reduction_factor)
    if name == "hyperband":
        return HyperBandScheduler(time_attr="training_iteration", metric=metric, mode=mode, max_t=max_t,
                                  reduction_factor=reduction_factor)
    if name == "sha":
        return HyperBandScheduler(time_attr="training_iteration", metric=metric, mode=mode, max_t=max_t,
                                  reduction_factor=reduction_factor, stop_last_trials=True)
    raise InvalidInput(f"unknown base scheduler {name!r}; known: {', '.join(BASES)}")


class FluidAllocation:
    """The allocation function (a callable object: Ray refuses a bound method)."""

    def __init__(self, controller: SweepController, cpu: float, clock: Callable[[], float]) -> None:
        self.controller, self.cpu, self.clock = controller, cpu, clock

    def __call__(self, tune_controller: Any, trial: Any, result: dict, scheduler: Any) -> PlacementGroupFactory | None:
        step_s = result.get(STEP_S)
        steps_left = result.get(STEPS_LEFT)
        if steps_left is None:
            raise InvalidInput(f"trial {trial.trial_id} reports no {STEPS_LEFT}: Fluid cannot size it")
        before = len(self.controller.log)
        # a checkpoint reported with this very result is registered only after the scheduler has seen the result;
        # Ray's pause then saves that checkpoint, so it counts
        checkpointed = trial.checkpoint is not None or bool(result.get(SHOULD_CHECKPOINT, False))
        width = self.controller.on_result(trial.trial_id, None if step_s is None else float(step_s),
                                          float(steps_left), checkpointed=checkpointed,
                                          now=self.clock())
        if len(self.controller.log) == before:
            return None
        return bundle(width, self.cpu)


class FluidScheduler(ResourceChangingScheduler):
    """ResourceChangingScheduler around a base scheduler, with Fluid's widths."""

    def __init__(self, base: TrialScheduler, config: FluidConfig, *, cpu_per_trial: float = 0.25,
                 on_event: Callable[[Event], None] | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        self.controller = SweepController(config, base_width=1.0)
        self.clock = clock or time.time  # the records' time only, every event's alike
        self.on_event = on_event
        self.cpu_per_trial = cpu_per_trial
        self._sent = 0
        self._died: set[str] = set()  # trials that died: Ray may add them again to retry them
        super().__init__(base_scheduler=base,
                         resources_allocation_function=FluidAllocation(self.controller, cpu_per_trial,
                                                                       self.clock))

    @property
    def log(self) -> list[Reallocation]:
        return self.controller.log

    def initial_resources(self) -> PlacementGroupFactory:
        """What every trial must start with (`tune.with_resources(trainable, scheduler.initial_resources())`)."""
        return bundle(1.0, self.cpu_per_trial)

    def on_trial_add(self, tune_controller: Any, trial: Any, **kwargs: Any) -> None:
        self._ensure_ending(tune_controller)
        group = sweep_of(trial)
        if trial.trial_id in self._died:
            # Ray retries it (TuneController._requeue_trial: on_trial_error, then on_trial_add) with the placement
            # group it held, or the one a pending resize gives it: not the base width
            self._died.discard(trial.trial_id)
            width = gpus_of(self._trials_to_reallocate.get(trial) or trial.placement_group_factory)
            self.controller.retried(trial.trial_id, group, width, now=self.clock())
            self._publish()
        else:
            self.controller.add(trial.trial_id, group, 0.0)
        super().on_trial_add(tune_controller, trial, **kwargs)

    def on_trial_result(self, tune_controller: Any, trial: Any, result: dict) -> str:
        # what Ray runs it at: its placement group (a resize takes effect only at the restart after its result)
        ids = result.get(GPU_IDS)
        node = result.get("node_ip", "")
        self.controller.running(trial.trial_id, gpus_of(trial.placement_group_factory),
                                [f"{node}/{i}" for i in ids] if ids else None, now=self.clock())
        before = self._trials_to_reallocate.get(trial)
        decision = super().on_trial_result(tune_controller, trial, result)
        if decision == TrialScheduler.PAUSE:
            resize = self._trials_to_reallocate.get(trial)
            if resize is not None and resize is not before:  # ours: Ray pauses it to restart it at its new width
                self._unpause_after_resize(trial)
            else:  # the base scheduler's (HyperBand at a rung): Ray frees its placement group until it resumes it
                steps_left = result.get(STEPS_LEFT)
                self.controller.paused(trial.trial_id, "paused by the base scheduler at the end of its round: its "
                                       "GPUs went back to the sweep",
                                       None if steps_left is None else float(steps_left), now=self.clock())
        self._publish()
        return decision

    def _unpause_after_resize(self, trial: Any) -> None:
        """A pause to resize is ours, not the base scheduler's, and Ray's ResourceChangingScheduler does not tell it.
        HyperBand restarts a paused trial only once its bracket lists it to unpause (HyperBandScheduler.
        choose_trial_to_run), and waits for every trial of a rung: unlisted, the resized trial and the sweep wait for
        good. So it is listed, as HyperBand lists the trials it continues itself. ASHA restarts any paused trial."""
        base = self._base_scheduler
        info = getattr(base, "_trial_info", None) if isinstance(base, HyperBandScheduler) else None
        if info is None or trial not in info:
            return
        info[trial][0].trials_to_unpause.add(trial)

    def choose_trial_to_run(self, tune_controller: Any, **kwargs: Any) -> Any:
        """Which trial Ray starts or resumes now (None: none). Ray's ResourceChangingScheduler first gives the trials
        paused to resize their new placement groups and asks the base scheduler (ASHA: the first PENDING trial, else
        the first PAUSED; HyperBand: a PENDING one or one its bracket lists to unpause); then the controller counts
        what Ray is about to start and holds back what would take the GPUs of a growth not placed yet (the module's
        doc). Idempotent, as Ray asks: called again with nothing changed, it answers the same."""
        chosen = super().choose_trial_to_run(tune_controller, **kwargs)
        trials = list(tune_controller.get_trials())
        ctrl = self.controller
        for trial in trials:
            if trial.status == Trial.PENDING:
                ctrl.pending(trial.trial_id, gpus_of(trial.placement_group_factory))
            elif (trial.status == Trial.RUNNING and trial.trial_id in ctrl.promised
                  and trial not in self._trials_to_reallocate):
                ctrl.growth_placed(trial.trial_id)  # it runs again, on the placement group it grew to
        growing = [t for t in trials if t.trial_id in ctrl.promised and t.status == Trial.PAUSED]
        if growing:
            return growing[0]  # the growth first: its placement group is requested now
        if chosen is None or chosen.trial_id in ctrl.promised:
            return chosen
        idle = not any(t.status == Trial.RUNNING for t in trials)
        return chosen if ctrl.may_start(chosen.trial_id, gpus_of(chosen.placement_group_factory), idle=idle) else None

    def on_trial_complete(self, tune_controller: Any, trial: Any, result: dict, **kwargs: Any) -> None:
        self.controller.finished(trial.trial_id, now=self.clock())
        self._publish()
        super().on_trial_complete(tune_controller, trial, result, **kwargs)

    def on_trial_error(self, tune_controller: Any, trial: Any, **kwargs: Any) -> None:
        # a trial that died (during a restart too) gives its GPUs back; Ray retries it (on_trial_add: it comes back
        # with the placement group it held) or reports it failed
        self.controller.finished(trial.trial_id, "died: its GPUs went back to the sweep", died=True, now=self.clock())
        self._died.add(trial.trial_id)
        self._publish()
        super().on_trial_error(tune_controller, trial, **kwargs)

    def on_trial_remove(self, tune_controller: Any, trial: Any, **kwargs: Any) -> None:
        self.controller.finished(trial.trial_id, "removed", now=self.clock())
        self._publish()
        super().on_trial_remove(tune_controller, trial, **kwargs)

    def ending(self) -> SweepEnd:
        """The Tune callback that ends the sweep's records with the experiment: pass it to the run
        (`tune.RunConfig(callbacks=[scheduler.ending()])`)."""
        return SweepEnd(self)

    def _ensure_ending(self, tune_controller: Any) -> None:
        """Adds `ending()` to the run's callbacks unless one is there already. Ray keeps a run's callbacks in
        TuneController._callbacks (a CallbackList over a plain list) and calls each at the experiment's end, so a
        callback added before then is called like one passed in the RunConfig."""
        callbacks = getattr(getattr(tune_controller, "_callbacks", None), "_callbacks", None)
        if not isinstance(callbacks, list):
            if not getattr(self, "_warned_ending", False):
                self._warned_ending = True
                log.warning("this Ray Tune release keeps its callbacks elsewhere: pass callbacks=[scheduler.ending()] "
                            "in the RunConfig, or trials of an experiment stopped as a whole stay counted")
            return
        if not any(isinstance(c, SweepEnd) and c.scheduler is self for c in callbacks):
            callbacks.append(SweepEnd(self))

    def experiment_ended(self) -> None:
        """The experiment ended: every trial still counted ends here. Ray stops the trials of an experiment stopped as
        a whole (a Stopper's stop_all, time_budget_s, fail_fast: TuneController._stop_experiment_if_needed) without
        telling the scheduler, so without this they would hold their GPUs in the records for good."""
        for trial_id in list(self.controller.trials):
            self.controller.finished(trial_id, "the experiment ended", now=self.clock())
        self._publish()

    def _publish(self) -> None:
        while self._sent < len(self.controller.events):
            if self.on_event is not None:
                self.on_event(self.controller.events[self._sent])
            self._sent += 1


class SweepEnd(Callback):
    """Tells the scheduler that the experiment ended (`FluidScheduler.experiment_ended`): Ray calls a callback's
    on_experiment_end however the experiment ends, and never the scheduler."""

    def __init__(self, scheduler: FluidScheduler) -> None:
        self.scheduler = scheduler

    def on_experiment_end(self, trials: list, **info: Any) -> None:
        self.scheduler.experiment_ended()


class StoreRecorder:
    """Writes a sweep's events into the store (the Sweeps page reads them). Ray Tune pickles the scheduler with the
    experiment's state, so the recorder keeps the database URL and opens its store again after unpickling."""

    def __init__(self, store: Store, sweep_id: str, config: FluidConfig) -> None:
        self.url = store.url.render_as_string(hide_password=False)
        self.sweep_id = sweep_id
        self._store: Store | None = store
        record_sweep(store, sweep_id, config.gpus, {
            "c": config.speed.max_share, "d": config.speed.max_span, "eta": config.speed.dp_efficiency,
            "restart_s": config.restart_s, "mode": "dynamic" if config.dynamic else "static"})

    def __getstate__(self) -> dict[str, Any]:
        return {"url": self.url, "sweep_id": self.sweep_id}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.url, self.sweep_id, self._store = state["url"], state["sweep_id"], None

    def __call__(self, event: Event) -> None:
        if self._store is None:
            self._store = Store(self.url)
        record_event(self._store, self.sweep_id, event.trial_id, event.kind, event.old_width, event.new_width,
                     reason=event.reason, steps_left=event.steps_left, now=event.at or None)
