"""The scheduler's end-of-experiment callback reaches the run without the user passing it, once, on a Ray Tune
callback list as the TuneController keeps it (no cluster)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from enforcer.sweeps.fluid import FluidConfig
from tests.sweeps.needs_ray import need_ray
from tests.sweeps.test_tune_choose import SPEED
from tests.sweeps.test_tune_groups import ray_trials


@pytest.fixture(autouse=True)
def _ray_tune() -> None:
    need_ray()


def _scheduler():
    from collector.tune.scheduler import FluidScheduler, base_scheduler

    return FluidScheduler(base_scheduler("asha", metric="loss", mode="min", max_t=100),
                          FluidConfig(4, SPEED, dynamic=True, restart_s=0.0))


@pytest.mark.parametrize("passed_by_user", [False, True])
def test_the_run_gets_the_scheduler_s_end_callback_once_and_it_ends_every_trial(tmp_path: Path,
                                                                                passed_by_user: bool) -> None:
    from ray.tune.callback import CallbackList

    from collector.tune.scheduler import SweepEnd

    sched = _scheduler()
    callbacks = CallbackList([sched.ending()] if passed_by_user else [])
    controller = SimpleNamespace(_callbacks=callbacks)  # where TuneController keeps the run's callbacks
    trials = ray_trials(tmp_path, "ended", [0.1, 0.01])
    for t in trials:
        sched.on_trial_add(controller, t)
    assert [type(c) for c in callbacks._callbacks] == [SweepEnd]
    assert set(sched.controller.trials) == {t.trial_id for t in trials}
    callbacks.on_experiment_end(trials=trials)  # what Ray calls however the experiment ends
    assert not sched.controller.trials


def test_a_controller_without_a_callback_list_gets_a_warning_not_an_error(tmp_path: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    sched = _scheduler()
    for t in ray_trials(tmp_path, "no-list", [0.1, 0.01]):
        sched.on_trial_add(SimpleNamespace(), t)
    assert len(sched.controller.trials) == 2
    warned = [r for r in caplog.records if "scheduler.ending()" in r.getMessage()]
    assert len(warned) == 1  # said once
