"""The controller behind Ray Tune: widths handed out at results, and every hold-back and death recorded."""

from __future__ import annotations

import pytest

from enforcer.sweeps.controller import SweepController
from enforcer.sweeps.fluid import FluidConfig, Kind, plan
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


def test_a_trial_that_dies_gives_its_gpus_back_and_a_retry_takes_the_width_it_held() -> None:
    """Ray retries a trial with the placement group it last held (TuneController._requeue_trial keeps it), not the
    base width: the controller counts those GPUs from the retry, and the others give them back."""
    ctrl = SweepController(FluidConfig(4, SPEED, restart_s=0.0))
    for t in ("a", "b"):
        ctrl.add(t, "g", 10)
    assert ctrl.on_result("a", 10.0, 9) == 3.0
    ctrl.finished("a", "died: its GPUs went back to the sweep", died=True)
    assert [e.kind for e in ctrl.events if e.trial_id == "a"] == ["start", "resize", "died"]
    ctrl.retried("a", "g", 3.0)  # Ray retries it at once (on_trial_error, then on_trial_add), on 3 GPUs
    back = [e for e in ctrl.events if e.trial_id == "a"][-1]
    assert (back.kind, back.new_width) == ("start", 3.0) and "came back" in back.reason
    assert ctrl.width("a") == 3.0
    assert ctrl.on_result("b", 10.0, 9) == 1.0  # a's GPUs are not b's: Ray gives them to a again
    ctrl.running("a", 3.0)
    assert ctrl.held() == 4
    assert ctrl.on_result("a", 10.0, 8) == 2.0  # measured again: planned from its own 3 GPUs, one goes to b
    assert ctrl.on_result("b", 10.0, 8) == 2.0
    assert ctrl.sequence() == [("a", 1.0, 3.0), ("a", 3.0, 2.0), ("b", 1.0, 2.0)]
    ctrl.finished("a", "died", died=True)  # not retried (its last failure): b takes its GPUs
    assert ctrl.on_result("b", 10.0, 7) == 4.0
    with pytest.raises(InvalidInput):
        ctrl.add("b", "g", 1)
    with pytest.raises(InvalidInput):
        ctrl.width("zzz")


def test_the_controller_follows_the_width_the_engine_runs_a_trial_at() -> None:
    ctrl = SweepController(FluidConfig(4, SPEED, restart_s=0.0))
    ctrl.add("a", "g", 10)
    ctrl.running("a", 2.0)  # its first result: started at 2 GPUs, not the base width
    assert ctrl.width("a") == 2.0 and ctrl.events[-1].kind == "start" and ctrl.events[-1].new_width == 2.0
    ctrl.running("a", 3.0)  # a width it did not hand out: followed, and recorded
    assert ctrl.width("a") == 3.0 and ctrl.events[-1].kind == "resize" and "engine" in ctrl.events[-1].reason
    ctrl.running("zzz", 1.0)  # back without the engine saying so
    assert ctrl.width("zzz") == 1.0 and "came back" in ctrl.events[-1].reason


def _fragmented() -> SweepController:
    """The reviewer's sequence on 4 GPUs: halves a and b on GPU 0 (Ray's best fit), c on GPU 1, d on GPU 2; none
    of a, b, c can be resized (no checkpoint), so only d moves."""
    ctrl = SweepController(FluidConfig(4, SPEED, restart_s=0.0))
    for t in "abcd":
        ctrl.add(t, "g", 10)
    for t, width, gpu in (("a", 0.5, "n/0"), ("b", 0.5, "n/0"), ("c", 0.5, "n/1"), ("d", 1.0, "n/2")):
        ctrl.running(t, width, [gpu])
    for t in "abc":
        assert ctrl.on_result(t, 0.1, 10, checkpointed=False) == 0.5
    return ctrl


def test_a_growth_waits_for_gpus_that_hold_no_share() -> None:
    """Ray keeps a fractional bundle on its GPU: with b gone, a (GPU 0) and c (GPU 1) hold two GPUs, not the one
    gpu_cost packs them into, and a three-GPU bundle does not fit beside them."""
    ctrl = _fragmented()
    assert ctrl.held("d") == 2  # a and b share GPU 0
    assert ctrl.on_result("d", 10.0, 10) == 2.0  # GPUs 2 and 3 hold nothing: placed
    ctrl.running("d", 2.0, ["n/2", "n/3"])
    ctrl.finished("b")
    assert ctrl.planned["d"].new_width == 3.0  # the plan packs a and c into one GPU...
    assert ctrl.held("d") == 2
    assert ctrl.on_result("d", 10.0, 9) == 2.0  # ...Ray cannot: the growth waits
    assert ctrl.sequence() == [("d", 1.0, 2.0)]
    ctrl.finished("c")  # GPU 1 holds nothing now
    assert ctrl.on_result("d", 10.0, 8) == 3.0
    assert ctrl.sequence() == [("d", 1.0, 2.0), ("d", 2.0, 3.0)]


def test_a_share_that_did_not_say_where_it_runs_counts_as_a_gpu_of_its_own() -> None:
    ctrl = SweepController(FluidConfig(4, SPEED, restart_s=0.0))
    for t in "abd":
        ctrl.add(t, "g", 10)
    ctrl.running("a", 0.5)
    ctrl.running("b", 0.5)
    ctrl.running("d", 1.0)
    for t in "ab":
        ctrl.on_result(t, 0.1, 10, checkpointed=False)
    assert ctrl.held("d") == 2
    assert ctrl.on_result("d", 10.0, 10) == 1.0  # gpu_cost([0.5, 0.5, 3]) is 4: it would hand out 3
    assert ctrl.planned["d"].new_width == 3.0
    ctrl.running("a", 0.5, ["n/0"])
    ctrl.running("b", 0.5, ["n/0"])  # now known to share one GPU
    assert ctrl.held("d") == 1 and ctrl.on_result("d", 10.0, 9) == 3.0


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


@pytest.mark.parametrize("steps_left", [float("nan"), float("inf"), -5.0])
def test_a_result_whose_steps_left_are_no_number_is_refused(steps_left: float) -> None:
    """NaN steps left used to read as "no steps left" (max(0, NaN) is 0): the trial silently ended its round with
    the GPUs it held and was never re-filled."""
    ctrl = SweepController(FluidConfig(4, SPEED, restart_s=0.0))
    ctrl.add("a", "g", 10)
    with pytest.raises(InvalidInput) as exc:
        ctrl.on_result("a", 10.0, steps_left)
    assert "'a'" in str(exc.value) and "steps" in str(exc.value)
    assert ctrl.trials["a"].remaining_steps == 10  # nothing was taken from the bad result
    with pytest.raises(InvalidInput):
        ctrl.add("b", "g", steps_left)


@pytest.mark.parametrize("width", [float("nan"), -1.0, float("inf")])
def test_a_width_the_engine_reports_that_is_no_width_is_refused(width: float) -> None:
    """A NaN width read as "not running" (NaN > 0 is false): the trial's GPUs were counted free and handed out
    again."""
    ctrl = SweepController(FluidConfig(4, SPEED, restart_s=0.0))
    ctrl.add("a", "g", 10)
    for report in (lambda: ctrl.running("a", width), lambda: ctrl.started("a", width),
                   lambda: ctrl.pending("a", width), lambda: ctrl.may_start("a", width),
                   lambda: ctrl.retried("b", "g", width)):
        with pytest.raises(InvalidInput):
            report()
    assert ctrl.width("a") == 0.0 and ctrl.starting == {}


def test_release_order_counts_every_trial_ever_added() -> None:
    """A trial's release order was the number of trials held when it was added: one added after another ended got
    the order of one still waiting, and the id decided which was measured first ("a" before "y")."""
    ctrl = SweepController(FluidConfig(1, SPEED, restart_s=0.0))
    ctrl.add("x", "g", 10)
    ctrl.add("y", "g", 10)
    ctrl.finished("x")
    ctrl.add("a", "g", 10)
    assert ctrl.trials["a"].order > ctrl.trials["y"].order
    decisions = {d.trial_id: d.kind for d in plan(list(ctrl.trials.values()), ctrl.config)}
    assert decisions == {"y": Kind.PROFILE, "a": Kind.WAIT}  # the one GPU measures the trial released first


def test_negative_steps_left_are_refused_and_the_sweep_goes_on_as_it_was() -> None:
    """A trial reporting -5 steps left (its own miscount) was read as a round overrun, none left: it was taken to have
    ended its round, kept the GPUs it held, and nothing said why."""
    ctrl = SweepController(FluidConfig(4, SPEED, restart_s=0.0))
    ctrl.add("a", "g", 10)
    ctrl.add("b", "g", 10)
    ctrl.on_result("a", 10.0, 8)
    ctrl.on_result("b", 10.0, 8)
    trials, planned, events = dict(ctrl.trials), dict(ctrl.planned), list(ctrl.events)
    for report in (lambda: ctrl.on_result("a", 10.0, -5.0), lambda: ctrl.paused("a", "rung", -5.0)):
        with pytest.raises(InvalidInput) as exc:
            report()
        assert "'a'" in str(exc.value) and "-5.0 steps left" in str(exc.value)
    assert (ctrl.trials, ctrl.planned, ctrl.events) == (trials, planned, events)  # nothing was taken from it
    assert ctrl.on_result("a", 10.0, 7) == ctrl.width("a") and ctrl.trials["a"].remaining_steps == 7
