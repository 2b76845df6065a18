"""A trial the base scheduler pauses at its rung (HyperBand, synchronous successive halving), on Ray's own Trial
objects and HyperBandScheduler without a cluster: Ray frees its placement group, so the trials still running grow
into its GPUs during the rung's barrier, and it is counted again once Ray resumes it."""

from __future__ import annotations

import pytest

from enforcer.sweeps.fluid import FluidConfig
from tests.sweeps.needs_ray import need_ray
from tests.sweeps.test_tune_choose import SPEED, Tune, experiment, trial


@pytest.fixture(autouse=True)
def _ray_tune(tmp_path) -> None:
    need_ray()
    experiment(str(tmp_path), "fluid-sweep")


class HyperBandTune(Tune):
    """The TuneController as HyperBand calls it too: it stops the trials a rung drops (TuneController.stop_trial:
    on_trial_remove for a PAUSED or PENDING one)."""

    def __init__(self, sched, *trials: object) -> None:
        super().__init__(*trials)
        self.sched = sched

    def stop_trial(self, t) -> None:
        self.sched.on_trial_remove(self, t)
        t.set_status("TERMINATED")


def result(sched, tune: Tune, t, iteration: int, loss: float, step_s: float, steps_left: float, gpu: int) -> str:
    from ray.tune.result import SHOULD_CHECKPOINT

    from collector.tune.scheduler import GPU_IDS, STEP_S, STEPS_LEFT

    return sched.on_trial_result(tune, t, {STEP_S: step_s, STEPS_LEFT: steps_left, GPU_IDS: [gpu], "node_ip": "n",
                                           SHOULD_CHECKPOINT: True, "training_iteration": iteration, "loss": loss})


def test_trials_grow_into_the_gpus_of_a_trial_paused_at_its_rung_and_it_is_counted_again_on_resume() -> None:
    """HyperBand (max_t 4, reduction 2) on 2 GPUs: a, b and c share a bracket whose rung is at iteration 2 (the
    bracket before it, x0-x2, has ended). b and c reach the rung and are paused until a, the straggler, gets there:
    a grows to both GPUs. At a's rung HyperBand drops a, the worst, and resumes b and c, each counted again."""
    from collector.tune.scheduler import FluidScheduler, base_scheduler

    sched = FluidScheduler(base_scheduler("hyperband", metric="loss", mode="min", max_t=4, reduction_factor=2),
                           FluidConfig(2, SPEED, dynamic=True, restart_s=0.0))
    xs = [trial(sched, f"x{i}") for i in range(3)]
    a, b, c = (trial(sched, t) for t in "abc")
    tune = HyperBandTune(sched, *xs, a, b, c)
    for x in xs:
        tune.stop_trial(x)
    held = []

    def run(t, iteration: int, loss: float, steps_left: float, gpu: int) -> str:
        decision = result(sched, tune, t, iteration, loss, 1.0, steps_left, gpu)
        held.append(sum(t.width for t in sched.controller.trials.values()))  # what the trials run at
        if decision == "PAUSE":
            t.set_status("PAUSED")
        return decision

    assert sched.choose_trial_to_run(tune) is a
    a.set_status("RUNNING")
    b.set_status("RUNNING")
    assert run(b, 1, 1.0, 1, 1) == "CONTINUE"  # a is slower: its first result comes later
    assert run(b, 2, 1.0, 0, 1) == "PAUSE"  # at the rung: Ray frees b's GPU
    assert b not in sched._trials_to_reallocate
    assert sched.choose_trial_to_run(tune) is c  # c takes it (HyperBand's pick), counted from now
    c.set_status("RUNNING")
    assert run(c, 1, 2.0, 1, 1) == "CONTINUE"
    assert run(c, 2, 2.0, 0, 1) == "PAUSE"
    assert sched.log == []
    # b and c wait at the rung holding nothing: a grows into GPU 1 at its first result
    assert run(a, 1, 3.0, 40, 0) == "PAUSE"
    assert [(r.trial_id, r.old_width, r.new_width) for r in sched.log] == [("a", 1.0, 2.0)]
    assert sched.choose_trial_to_run(tune) is a  # its growth is restarted first
    a.set_status("RUNNING")
    assert sched.choose_trial_to_run(tune) is None  # HyperBand: b and c wait for a at the rung
    # a at the rung, the worst: HyperBand drops it and resumes b and c, each counted again once chosen
    assert run(a, 2, 3.0, 0, 0) == "STOP"
    sched.on_trial_complete(tune, a, {})
    a.set_status("TERMINATED")
    assert sched.choose_trial_to_run(tune) is b
    b.set_status("PENDING")  # staged
    assert sched.controller.held() == 1
    b.set_status("RUNNING")
    assert sched.choose_trial_to_run(tune) is c
    assert sched.controller.held() == 2
    assert max(held) <= 2  # never more than the cluster has
    kinds = [(e.trial_id, e.kind, e.new_width) for e in sched.controller.events if e.trial_id == "b"]
    assert ("b", "wait", 0.0) in kinds
