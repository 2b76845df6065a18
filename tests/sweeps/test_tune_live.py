"""A real Ray Tune sweep on logical GPUs under the Fluid scheduler, against the simulator's model of it."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from enforcer.sim.sweeps.tune_model import run_tune_model
from enforcer.sweeps.fluid import FluidConfig
from enforcer.sweeps.speed import SpeedModel
from store.db import Store
from store.sweeps import events, gpu_use
from tests.procs import processes_under

pytestmark = [pytest.mark.ray, pytest.mark.slow]

GPUS = 4
SPEED = SpeedModel(dp_efficiency=0.85, share_speeds=(1.0, 0.65), max_span=4)
# (name, seconds per step alone, steps): chosen so that the order of events does not hang on Ray's timing on a busy
# machine: the model gives the same reallocations for any start-up of 0.5 to 8 s per trial and restarts of 1 to 25 s
TRIALS = [("a", 2.0, 2), ("b", 12.0, 4)]
SCALE = 1.0  # wall seconds per simulated second in the live run


def _ray():
    try:
        import ray
        from ray import tune
    except ImportError:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("Ray Tune is not installed, and the ray tests must run when CI=true (pip install .[tune])")
        pytest.skip("Ray Tune is not installed (the tune extra)")
    return ray, tune


@pytest.fixture
def ray_cluster(fleet_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """Ray on 2 CPUs and 4 logical GPUs, its processes marked by the test's FLEETLENS_HOME; stopped however the
    test ends, and no raylet or GCS left behind."""
    ray, _ = _ray()
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    temp = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    try:
        for attempt in (1, 2):  # Ray waits a fixed 30 s for its raylet; a loaded machine may need a second go
            try:
                ray.init(num_cpus=2, num_gpus=GPUS, include_dashboard=False, _temp_dir=temp, log_to_driver=False,
                         configure_logging=False)
                break
            except Exception as exc:  # Ray raises a bare Exception for this
                ray.shutdown()
                if attempt == 2 or "timed out during startup" not in str(exc):
                    raise
                for proc in processes_under(tmp_path):
                    proc.kill()
        yield ray
    finally:
        ray.shutdown()
        deadline = time.monotonic() + 20
        while processes_under(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = processes_under(tmp_path)
        shutil.rmtree(temp, ignore_errors=True)
        assert not left, f"Ray left processes running: {[p.pid for p in left]}"


def test_live_and_simulated_make_the_same_reallocations_in_order(ray_cluster: object, tmp_path: Path,
                                                                 sqlite_store: Store) -> None:
    from ray import tune

    from collector.tune.scheduler import FluidScheduler, StoreRecorder, base_scheduler
    from tests.sweeps.tune_job import train

    config = FluidConfig(GPUS, SPEED, dynamic=True, restart_s=1.0)
    max_t = max(n for _, _, n in TRIALS)
    scheduler = FluidScheduler(base_scheduler("asha", metric="loss", mode="min", max_t=max_t, grace_period=max_t),
                               config, on_event=StoreRecorder(sqlite_store, "fluid-live", config))
    names = {name: (step_s, steps) for name, step_s, steps in TRIALS}
    space = {"name": tune.grid_search([n for n, _, _ in TRIALS]), "eta": SPEED.dp_efficiency,
             "share_speeds": list(SPEED.share_speeds), "d": SPEED.max_span, "scale": SCALE, "seed": 0,
             "step_s": tune.sample_from(lambda spec: names[spec.config.name][0]),
             "steps": tune.sample_from(lambda spec: names[spec.config.name][1])}
    tuner = tune.Tuner(
        tune.with_resources(train, scheduler.initial_resources()),
        param_space=space,
        tune_config=tune.TuneConfig(scheduler=scheduler, reuse_actors=False),
        run_config=tune.RunConfig(storage_path=str(tmp_path / "ray_results"), name="fluid", verbose=0),
    )
    results = tuner.fit()
    assert not results.errors
    by_id = {r.metrics["trial_id"]: r.config["name"] for r in results}
    live = [(by_id[r.trial_id], r.old_width, r.new_width) for r in scheduler.log]
    simulated = run_tune_model(TRIALS, config, start_s=2.0, restart_s=3.0, max_t=max_t).sequence()
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
        tune_config=tune.TuneConfig(scheduler=scheduler, reuse_actors=False, time_budget_s=150),
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
