"""The sweep a Ray Tune trial belongs to, on trials made as Ray makes them (an Experiment expanded by Ray's
BasicVariantGenerator, whose tag is per trial: "0_lr=0.1"), without a cluster."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from enforcer.sweeps.fluid import FluidConfig, Kind, plan
from store.errors import InvalidInput
from tests.sweeps.needs_ray import need_ray
from tests.sweeps.test_tune_choose import SPEED


@pytest.fixture(autouse=True)
def _ray_tune() -> None:
    need_ray()


def _train(config: dict) -> None:
    """A trainable Ray only registers here (nothing runs it)."""


def ray_trials(storage: Path, name: str, lrs: list[float]) -> list:
    """The trials Ray makes of `tune.Tuner(..., param_space={"lr": tune.grid_search(lrs)}, run_config=RunConfig(
    name=name))`."""
    from ray import tune
    from ray.tune.experiment import Experiment
    from ray.tune.search import BasicVariantGenerator

    experiment = Experiment(name, tune.with_resources(_train, {"CPU": 0.25, "GPU": 1.0}),
                            config={"lr": tune.grid_search(lrs)}, storage_path=str(storage))
    searcher = BasicVariantGenerator()
    searcher.add_configurations([experiment])
    trials = []
    while (t := searcher.next_trial()) is not None:
        trials.append(t)
    return trials


def test_the_trials_of_one_experiment_are_one_group_and_static_mode_waits_for_all_of_it(tmp_path: Path) -> None:
    """Static mode fills a group once all of it is measured: with one trial of the sweep measured and waiting, and
    the others not measured yet, it waits (it would start at once were each trial a group of its own)."""
    from collector.tune.scheduler import FluidScheduler, base_scheduler

    config = FluidConfig(4, SPEED, dynamic=False, restart_s=0.0)
    sched = FluidScheduler(base_scheduler("asha", metric="loss", mode="min", max_t=100), config)
    trials = ray_trials(tmp_path, "lr-sweep", [0.1, 0.01, 0.001])
    assert len({t.experiment_tag for t in trials}) == 3  # Ray's tag is per trial
    for t in trials:
        sched.on_trial_add(None, t)
    states = list(sched.controller.trials.values())
    first = trials[0].trial_id
    measured = [replace(s, step_s=2.0, remaining_steps=10.0) if s.trial_id == first else s for s in states]
    decision = next(d for d in plan(measured, config) if d.trial_id == first)
    assert decision.kind == Kind.WAIT and decision.reason.startswith("static")
    assert {s.group for s in states} == {"lr-sweep"}  # the experiment's name


def test_a_trial_with_no_experiment_is_refused_with_the_reason(tmp_path: Path) -> None:
    from ray.tune.experiment import Trial

    from collector.tune.scheduler import FluidScheduler, base_scheduler

    sched = FluidScheduler(base_scheduler("asha", metric="loss", mode="min", max_t=100),
                           FluidConfig(4, SPEED, dynamic=False))
    t = Trial("fluid", stub=True, trial_id="t0", experiment_tag="0_lr=0.1",
              placement_group_factory=sched.initial_resources())
    with pytest.raises(InvalidInput, match="no Ray Tune experiment"):
        sched.on_trial_add(None, t)
