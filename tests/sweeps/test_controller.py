"""The controller behind Ray Tune: widths handed out at results, and every hold-back and death recorded."""

from __future__ import annotations

import pytest

from enforcer.sweeps.controller import SweepController
from enforcer.sweeps.fluid import FluidConfig
from enforcer.sweeps.speed import SpeedModel
from store.errors import InvalidInput

SPEED = SpeedModel(dp_efficiency=0.85, share_speeds=(1.0, 0.65), max_span=4)


def test_a_trial_without_checkpoint_keeps_its_gpu_and_the_reason_is_recorded() -> None:
    ctrl = SweepController(FluidConfig(4, SPEED, restart_s=0.0))
    ctrl.add("a", "g", 10)
    assert ctrl.on_result("a", 5.0, 9, checkpointed=False) == 1.0
    assert ctrl.log == []
    keeps = [e for e in ctrl.events if e.kind == "keep"]
    assert len(keeps) == 1 and "no checkpoint" in keeps[0].reason
    assert ctrl.on_result("a", 5.0, 8, checkpointed=True) == 4.0  # once it has one, it widens
    assert ctrl.sequence() == [("a", 1.0, 4.0)]


def test_a_growth_waits_for_free_gpus_and_a_shrink_comes_first() -> None:
    ctrl = SweepController(FluidConfig(4, SPEED, restart_s=0.0))
    for t in ("a", "b"):
        ctrl.add(t, "g", 10)
    assert ctrl.on_result("a", 10.0, 9) == 3.0  # b not measured yet: one GPU kept for its profiling step
    assert ctrl.on_result("b", 10.0, 9) == 1.0  # b's share needs GPUs a still holds
    assert ctrl.on_result("a", 10.0, 8) == 2.0  # a gives them back at its next result
    assert ctrl.on_result("b", 10.0, 8) == 2.0
    assert ctrl.sequence() == [("a", 1.0, 3.0), ("a", 3.0, 2.0), ("b", 1.0, 2.0)]


def test_a_trial_that_dies_gives_its_gpus_back_and_is_planned_again_if_it_returns() -> None:
    ctrl = SweepController(FluidConfig(4, SPEED, restart_s=0.0))
    for t in ("a", "b"):
        ctrl.add(t, "g", 10)
    ctrl.on_result("a", 10.0, 9)
    ctrl.finished("a", "died: its GPUs went back to the sweep", died=True)
    assert [e.kind for e in ctrl.events if e.trial_id == "a"] == ["start", "resize", "died"]
    assert ctrl.on_result("b", 10.0, 9) == 4.0  # a's GPUs are b's now
    assert ctrl.on_result("a", 10.0, 9) == 1.0  # a retried: back at the base width, nothing lost
    back = [e for e in ctrl.events if e.trial_id == "a"][-1]
    assert back.kind == "start" and "came back" in back.reason
    with pytest.raises(InvalidInput):
        ctrl.add("b", "g", 1)
    with pytest.raises(InvalidInput):
        ctrl.width("zzz")


def test_more_trials_than_the_fleet_holds_each_keep_a_record() -> None:
    ctrl = SweepController(FluidConfig(2, SpeedModel(0.85, (1.0,), 4), restart_s=0.0))
    for i in range(4):
        ctrl.add(f"t{i}", "g", 10)
    assert ctrl.on_result("t0", 1.0, 9) == 1.0
    assert ctrl.on_result("t1", 1.0, 9) == 1.0
    assert {t for t in ctrl.trials} == {"t0", "t1", "t2", "t3"}  # the waiting ones are still there
    waits = {e.trial_id: e.reason for e in ctrl.events if e.kind == "wait"}
    assert set(waits) == {"t2", "t3"} and all("no whole GPU free" in r for r in waits.values())
    ctrl.finished("t0")
    assert ctrl.on_result("t2", 1.0, 9) == 1.0  # started by the engine once t0's GPU was free
    assert [e.kind for e in ctrl.events].count("wait") == 2  # a reason is recorded once, not on every result
