"""A real Ray Tune sweep on logical GPUs under the Fluid scheduler, against the simulator's model of it."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from enforcer.sim.sweeps.tune_model import run_tune_model
from enforcer.sweeps.fluid import FluidConfig
from enforcer.sweeps.speed import SpeedModel
from store.db import Store
from store.sweeps import events, gpu_use
from tests.procs import kill_all, processes_under
from tests.sweeps.needs_ray import need_ray

pytestmark = [pytest.mark.ray, pytest.mark.slow]

GPUS = 4
SPEED = SpeedModel(dp_efficiency=0.85, share_speeds=(1.0, 0.65), max_span=4)
# (name, seconds per step alone, steps): chosen so that the order of events does not hang on Ray's timing on a busy
# machine: the model gives the same reallocations for any start-up of 0.5 to 8 s per trial and restarts of 1 to 25 s
TRIALS = [("a", 2.0, 2), ("b", 12.0, 4)]
SCALE = 1.0  # wall seconds per simulated second in the live run
FLUID = FluidConfig(GPUS, SPEED, dynamic=True, restart_s=1.0)


class _Cluster:
    """Ray on 2 CPUs and 4 logical GPUs, its processes marked by `home` (FLEETLENS_HOME, set before it starts)."""

    def __init__(self, ray: object, home: Path, temp: str) -> None:
        self.ray, self.home, self.temp = ray, home, temp

    def start(self) -> None:
        for attempt in (1, 2):  # Ray waits a fixed 30 s for its raylet; a loaded machine may need a second go
            try:
                self.ray.init(num_cpus=2, num_gpus=GPUS, include_dashboard=False, _temp_dir=self.temp,
                              log_to_driver=False, configure_logging=False)
                return
            except Exception as exc:  # Ray raises a bare Exception for this
                self.ray.shutdown()
                if attempt == 2 or "timed out during startup" not in str(exc):
                    raise
                kill_all(processes_under(self.home))

    def stop(self) -> list[psutil.Process]:
        """Ray shut down; the processes of it still running 20 s later, killed (returned to be named)."""
        self.ray.shutdown()
        deadline = time.monotonic() + 20
        while processes_under(self.home) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = processes_under(self.home)
        kill_all(left)
        return left

    def clean(self) -> bool:
        """Every placement group a test left (its own, or a trial's that Tune did not end) removed, which ends the
        actors and tasks in it; True once all the CPUs and GPUs are free again (within 30 s)."""
        from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group

        for pg_id, info in placement_group_table().items():
            if info["state"] != "REMOVED":
                remove_placement_group(PlacementGroup(self.ray.PlacementGroupID(bytes.fromhex(pg_id))))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            free = self.ray.available_resources()
            if free.get("CPU", 0.0) == 2.0 and free.get("GPU", 0.0) == GPUS:
                return True
            time.sleep(0.2)
        return False


@pytest.fixture(scope="module")
def ray_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Cluster]:
    """One Ray cluster for the module (starting one takes 20 to 40 s here), its processes marked by a FLEETLENS_HOME
    of the module's own; stopped however the module ends, and no raylet, GCS or worker left behind."""
    ray, _ = need_ray()
    home = tmp_path_factory.mktemp("rayhome")
    temp = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    cluster = _Cluster(ray, home, temp)
    with pytest.MonkeyPatch.context() as env:  # Ray's processes inherit the environment ray.init runs in
        for var in list(os.environ):
            if var.startswith("FLEETLENS_") and var != "FLEETLENS_TEST_PG_URL":
                env.delenv(var)
        env.setenv("FLEETLENS_HOME", str(home))
        env.setenv("RAY_USAGE_STATS_ENABLED", "0")
        try:
            cluster.start()
            yield cluster
        finally:
            left = cluster.stop()
            shutil.rmtree(temp, ignore_errors=True)
            assert not left, f"Ray left processes running: {[p.pid for p in left]}"


@pytest.fixture
def ray_cluster(ray_module: _Cluster) -> Iterator[object]:
    """The module's Ray cluster, all of it free for the test; after it, whatever the test left on it is removed, and
    if Ray does not get all its CPUs and GPUs back the cluster is restarted for the next test."""
    if not ray_module.ray.is_initialized():
        ray_module.start()
    yield ray_module.ray
    try:
        clean = ray_module.clean()
    except Exception:  # Ray itself broke in the test: a new cluster for the next
        clean = False
    if not clean:
        left = ray_module.stop()
        print(f"Ray did not free its resources after the test: restarted (killed {[p.pid for p in left]})")


def _fluid_sweep(tmp_path: Path, store: Store, name: str, *, callbacks: tuple = (),
                 **run: object) -> tuple[object, object]:
    """TRIALS under a dynamic Fluid scheduler on an ASHA base recording into `store` as sweep `name`: the scheduler
    and the Tuner, with `callbacks` and the rest of `run` (e.g. stop) in its RunConfig."""
    from ray import tune

    from collector.tune.scheduler import FluidScheduler, StoreRecorder, base_scheduler
    from tests.sweeps.tune_job import train

    max_t = max(n for _, _, n in TRIALS)
    scheduler = FluidScheduler(base_scheduler("asha", metric="loss", mode="min", max_t=max_t, grace_period=max_t),
                               FLUID, on_event=StoreRecorder(store, name, FLUID))
    names = {trial: (step_s, steps) for trial, step_s, steps in TRIALS}
    space = {"name": tune.grid_search([n for n, _, _ in TRIALS]), "eta": SPEED.dp_efficiency,
             "share_speeds": list(SPEED.share_speeds), "d": SPEED.max_span, "scale": SCALE, "seed": 0,
             "step_s": tune.sample_from(lambda spec: names[spec.config.name][0]),
             "steps": tune.sample_from(lambda spec: names[spec.config.name][1])}
    tuner = tune.Tuner(
        tune.with_resources(train, scheduler.initial_resources()),
        param_space=space,
        tune_config=tune.TuneConfig(scheduler=scheduler, reuse_actors=False),
        run_config=tune.RunConfig(storage_path=str(tmp_path / "ray_results"), name=name, verbose=0,
                                  callbacks=list(callbacks), **run),
    )
    return scheduler, tuner


def test_live_and_simulated_make_the_same_reallocations_in_order(ray_cluster: object, tmp_path: Path,
                                                                 sqlite_store: Store) -> None:
    from ray import tune

    groups: dict[str, str] = {}  # trial -> the group the controller put it in

    class Groups(tune.Callback):
        def on_trial_result(self, iteration: int, trials: list, trial: object, result: dict, **info: object) -> None:
            groups[trial.trial_id] = scheduler.controller.trials[trial.trial_id].group

    scheduler, tuner = _fluid_sweep(tmp_path, sqlite_store, "fluid-live", callbacks=(Groups(),))
    names = {name for name, _, _ in TRIALS}
    max_t = max(n for _, _, n in TRIALS)
    results = tuner.fit()
    assert not results.errors
    assert len(groups) == len(TRIALS) and set(groups.values()) == {"fluid-live"}  # one sweep: the experiment
    by_id = {r.metrics["trial_id"]: r.config["name"] for r in results}
    live = [(by_id[r.trial_id], r.old_width, r.new_width) for r in scheduler.log]
    simulated = run_tune_model(TRIALS, FLUID, start_s=2.0, restart_s=3.0, max_t=max_t).sequence()
    assert live == simulated
    assert live == [("a", 1.0, 3.0), ("b", 1.0, 4.0)]
    # every trial ran all its steps; a resized one resumed from its checkpoint with its new GPUs
    assert sorted(r.config["name"] for r in results) == sorted(names)
    assert all(r.metrics["fleetlens_steps_left"] == 0 for r in results)
    widths = {by_id[r.trial_id]: r.new_width for r in scheduler.log}
    for r in results:
        name = r.config["name"]
        if name in widths:
            assert r.metrics["width"] == widths[name]
            assert r.metrics["resumed_at"] > 0
    # the store has the sweep: each trial's start, its resize, its finish, in order
    rows = events(sqlite_store, "fluid-live")
    kinds = [(by_id[r.trial_id], r.kind) for r in rows]
    assert kinds.count(("a", "resize")) == 1 and kinds.count(("b", "finish")) == 1
    assert kinds.index(("a", "start")) < kinds.index(("a", "resize")) < kinds.index(("a", "finish"))
    use = gpu_use(rows, GPUS)
    assert max(held for _, held, _ in use) == 4.0  # b alone on all four GPUs at the end
    assert all(held >= one for _, held, one in use) and use[-1][1] == 0.0


def test_a_sweep_stopped_as_a_whole_ends_every_trial_in_the_records(ray_cluster: object, tmp_path: Path,
                                                                    sqlite_store: Store) -> None:
    """A Stopper's stop_all (as time_budget_s and fail_fast) makes Ray stop every trial without telling the scheduler
    (TuneController._stop_experiment_if_needed): the scheduler's callback ends them in the records with the
    experiment, so the Sweeps page shows none holding GPUs after the sweep."""
    from ray import tune

    class StopAll(tune.Stopper):  # the whole experiment stops after the first result
        def __init__(self) -> None:
            self.seen = False

        def __call__(self, trial_id: str, result: dict) -> bool:
            self.seen = True
            return False

        def stop_all(self) -> bool:
            return self.seen

    # no `ending()` in the run's callbacks: the scheduler adds it itself
    scheduler, tuner = _fluid_sweep(tmp_path, sqlite_store, "fluid-stop", stop=StopAll())
    tuner.fit()
    rows = events(sqlite_store, "fluid-stop")
    started = {r.trial_id for r in rows if r.kind == "start"}
    assert started, "no trial reported before the stop: nothing tested"
    assert started <= {r.trial_id for r in rows if r.kind in ("finish", "died")}
    assert gpu_use(rows, GPUS)[-1][1] == 0.0
    assert not scheduler.controller.trials


def test_a_hyperband_sweep_resumes_the_trials_it_resizes(ray_cluster: object, tmp_path: Path) -> None:
    """HyperBand restarts a paused trial only when its bracket lists it; a pause to resize is listed, or the resized
    trial and its whole rung would wait for good (here: until the time budget ends the sweep unfinished)."""
    from ray import tune

    from collector.tune.scheduler import FluidScheduler, base_scheduler
    from tests.sweeps.tune_job import train

    config = FluidConfig(GPUS, SPEED, dynamic=True, restart_s=1.0)
    trials = {"a": (2.0, 9), "b": (12.0, 9)}
    scheduler = FluidScheduler(base_scheduler("hyperband", metric="loss", mode="min", max_t=9), config)
    space = {"name": tune.grid_search(list(trials)), "eta": SPEED.dp_efficiency,
             "share_speeds": list(SPEED.share_speeds), "d": SPEED.max_span, "scale": 0.1, "seed": 0,
             "step_s": tune.sample_from(lambda spec: trials[spec.config.name][0]),
             "steps": tune.sample_from(lambda spec: trials[spec.config.name][1])}
    tuner = tune.Tuner(
        tune.with_resources(train, scheduler.initial_resources()),
        param_space=space,
        tune_config=tune.TuneConfig(scheduler=scheduler, reuse_actors=False, time_budget_s=300),
        run_config=tune.RunConfig(storage_path=str(tmp_path / "ray_results"), name="fluid-hb", verbose=0),
    )
    results = tuner.fit()
    assert not results.errors
    resized = {r.trial_id for r in scheduler.log}
    assert resized, "the sweep was never resized: nothing tested"
    # every trial ran all its steps, the resized ones resumed from a checkpoint at their last width
    assert all(r.metrics["fleetlens_steps_left"] == 0 for r in results)
    last = {r.trial_id: r.new_width for r in scheduler.log}
    for r in results:
        if r.metrics["trial_id"] in resized:
            assert r.metrics["resumed_at"] > 0 and r.metrics["width"] == last[r.metrics["trial_id"]]


def test_a_resized_trial_that_dies_is_retried_with_the_gpus_it_held(ray_cluster: object, tmp_path: Path) -> None:
    """Ray retries a trial with the placement group it last held (TuneController._requeue_trial keeps it): the
    controller must count those GPUs, not the base width, or it hands them to the other trial and Ray needs more GPUs
    than there are. At every result the controller's width is what Ray runs the trial at (or the width a resize
    decided at this result gives it)."""
    from ray import tune

    from collector.tune.scheduler import FluidScheduler, base_scheduler, gpus_of
    from tests.sweeps.tune_job import train

    config = FluidConfig(GPUS, SPEED, dynamic=True, restart_s=1.0)
    # one trial: the controller widens it at its first result whatever the machine's timing (its decisions read the
    # reported step time, not the clock); it then dies in its first step on more than one GPU
    trials = {"a": (2.0, 4, True)}
    max_t = 4
    scheduler = FluidScheduler(base_scheduler("asha", metric="loss", mode="min", max_t=max_t, grace_period=max_t),
                               config)
    seen: list[tuple[str, float, float]] = []  # (trial, what Ray runs or will run it at, the controller's width)
    held: list[float] = []

    class Check(tune.Callback):
        def on_trial_result(self, iteration: int, trials: list, trial: object, result: dict, **info: object) -> None:
            pending = scheduler._trials_to_reallocate.get(trial)
            ray_width = gpus_of(pending) if pending else float(result["width"])
            seen.append((trial.config["name"], ray_width, scheduler.controller.width(trial.trial_id)))
            held.append(sum(t.width for t in scheduler.controller.trials.values()))

    space = {"name": tune.grid_search(list(trials)), "eta": SPEED.dp_efficiency,
             "share_speeds": list(SPEED.share_speeds), "d": SPEED.max_span, "scale": SCALE, "seed": 0,
             "step_s": tune.sample_from(lambda spec: trials[spec.config.name][0]),
             "steps": tune.sample_from(lambda spec: trials[spec.config.name][1]),
             "fail_wide": tune.sample_from(lambda spec: trials[spec.config.name][2]),
             "marker": str(tmp_path / "died")}
    tuner = tune.Tuner(
        tune.with_resources(train, scheduler.initial_resources()),
        param_space=space,
        tune_config=tune.TuneConfig(scheduler=scheduler, reuse_actors=False, time_budget_s=300),
        run_config=tune.RunConfig(storage_path=str(tmp_path / "ray_results"), name="fluid-retry", verbose=0,
                                  failure_config=tune.FailureConfig(max_failures=1), callbacks=[Check()]),
    )
    results = tuner.fit()
    assert not results.errors
    assert (tmp_path / "died").exists(), "a never died: nothing tested"
    by_id = {r.metrics["trial_id"]: r.config["name"] for r in results}
    died = [e for e in scheduler.controller.events if e.kind == "died"]
    assert len(died) == 1 and by_id[died[0].trial_id] == "a"
    assert died[0].old_width > 1.0, f"a died on {died[0].old_width} GPU: not the resized trial the test needs"
    back = [e for e in scheduler.controller.events if e.trial_id == died[0].trial_id and "came back" in e.reason]
    assert len(back) == 1 and back[0].kind == "start" and back[0].new_width == died[0].old_width
    assert seen and all(ray == ours for _, ray, ours in seen), (seen, scheduler.controller.events)
    assert max(held) <= GPUS
    assert all(r.metrics["fleetlens_steps_left"] == 0 for r in results)
    a = next(r for r in results if r.config["name"] == "a")
    assert a.metrics["resumed_at"] > 0  # it resumed from its checkpoint


def test_every_growth_the_controller_hands_out_is_placed_by_ray(ray_cluster: object) -> None:
    """Ray keeps each fractional bundle on the GPU it put it on (the tightest fit): with halves a and b on one GPU,
    c on another and b gone, a 3-GPU bundle does not fit, though gpu_cost packs a and c into one GPU. The controller
    hands out a growth only into GPUs that hold nothing; each width it hands out here gets placed (Ray places each
    bundle within 30 s, or the test fails)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from enforcer.sweeps.controller import SweepController

    @ray.remote(num_cpus=0)
    def gpu_ids() -> list[str]:
        return [str(i) for i in ray.get_gpu_ids()]

    groups: dict[str, object] = {}

    def place(trial: str, width: float) -> list[str]:
        """Ray's placement of the trial's one bundle (its old one removed first, as a restart does)."""
        if trial in groups:
            remove_placement_group(groups.pop(trial))
        pg = placement_group([{"GPU": width}])
        assert pg.wait(timeout_seconds=30), f"Ray could not place {trial} on {width} GPUs"
        groups[trial] = pg
        strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0)
        return ray.get(gpu_ids.options(num_gpus=width, scheduling_strategy=strategy).remote(), timeout=30)

    def end(trial: str) -> None:
        remove_placement_group(groups.pop(trial))
        ctrl.finished(trial)

    ctrl = SweepController(FluidConfig(GPUS, SPEED, restart_s=0.0))
    for t in "abcd":
        ctrl.add(t, "g", 10)
    for t, width in (("a", 0.5), ("b", 0.5), ("c", 0.5), ("d", 1.0)):
        ctrl.running(t, width, place(t, width))
    assert ctrl.placed["a"][1] == ctrl.placed["b"][1] != ctrl.placed["c"][1]  # a and b share a GPU
    for t in "abc":  # no checkpoint: they keep their shares, only d moves
        ctrl.on_result(t, 0.1, 10, checkpointed=False)
    widths = []
    for steps_left, gone in ((10, None), (9, "b"), (8, "c")):
        if gone:
            end(gone)
        width = ctrl.on_result("d", 10.0, steps_left)
        if width != ctrl.placed["d"][0]:
            widths.append(width)
            ctrl.running("d", width, place("d", width))  # placed, or the test fails here
        if gone == "b":  # the growth the plan wants (3) waits: Ray could not place it beside a and c (a pending
            # probe is no proof here: Ray 2.60 keeps GPUs reserved for a pending placement group it removed)
            assert ctrl.planned["d"].new_width == 3.0 and width == 2.0
    assert widths == [2.0, 3.0]
    for t in list(groups):
        remove_placement_group(groups.pop(t))


def test_every_event_takes_the_scheduler_s_clock() -> None:
    """Start, resize, death, retry and end: all on the clock the scheduler was given (no Ray cluster needed)."""
    need_ray()
    from ray.tune.schedulers import FIFOScheduler

    from collector.tune.scheduler import FluidScheduler

    class Trial:  # what the scheduler reads of Ray's (hashable, as Ray's trials are)
        def __init__(self, trial_id: str, resources: object) -> None:
            self.trial_id, self.experiment_tag = trial_id, f"0_name={trial_id}"
            self.storage = SimpleNamespace(experiment_dir_name="fluid")  # Ray's StorageContext: the experiment
            self.placement_group_factory = resources

    events = []
    scheduler = FluidScheduler(FIFOScheduler(), FluidConfig(GPUS, SPEED, dynamic=True, restart_s=1.0),
                               on_event=events.append, clock=lambda: 1000.0)
    trials = [Trial(t, scheduler.initial_resources()) for t in ("a", "b")]
    for trial in trials:
        scheduler.on_trial_add(None, trial)
    scheduler.controller.on_result("a", 2.0, 5.0, now=scheduler.clock())
    scheduler.on_trial_error(None, trials[0])  # died, then Ray retries it
    scheduler.on_trial_add(None, trials[0])
    scheduler.on_trial_complete(None, trials[0], {})
    scheduler.on_trial_remove(None, trials[1])
    scheduler._publish()
    kinds = [e.kind for e in events]
    assert {"start", "died", "finish"} <= set(kinds)
    assert [e.at for e in events] == [1000.0] * len(events)
