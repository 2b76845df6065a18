"""The Fluid allocator: widths from heights, c and d, static and dynamic, profiling, the restart-cost skip rule."""

from __future__ import annotations

import pytest

from enforcer.sweeps.fluid import FluidConfig, Kind, TrialState, apply, config_from_settings, fill, plan
from enforcer.sweeps.speed import SpeedModel, from_lucid, gpu_cost, lanes_admitted
from store.errors import InvalidInput
from store.settings import get_settings
from tests.conftest import FLEET

SPEED = SpeedModel(dp_efficiency=0.85, share_speeds=(1.0, 0.65), max_span=4)


def trial(tid: str, step_s: float | None, steps: float = 100.0, width: float = 0.0, **kw) -> TrialState:
    return TrialState(tid, kw.pop("group", "g"), steps, step_s, width, order=int(tid[1:]), **kw)


def test_widths_follow_heights_and_fill_the_gpus() -> None:
    w = fill({"t0": 100.0, "t1": 100.0, "t2": 300.0}, 8, SPEED)
    assert w == {"t0": 2.0, "t1": 2.0, "t2": 4.0}  # the longest gets the most, capped at d
    assert gpu_cost(list(w.values())) == 8


def test_d_caps_a_lone_trial_and_c_floors_many() -> None:
    assert fill({"t0": 100.0}, 8, SPEED) == {"t0": 4.0}
    narrow = SpeedModel(0.85, (1.0, 0.65), max_span=2)
    assert fill({"t0": 100.0}, 8, narrow) == {"t0": 2.0}
    many = fill({f"t{i}": 100.0 for i in range(16)}, 8, SPEED)
    assert set(many.values()) == {0.5}  # 16 trials, 8 GPUs, c = 2: two to a GPU
    alone = fill({f"t{i}": 100.0 for i in range(16)}, 8, SpeedModel(0.85, (1.0,), 4))  # c = 1
    assert sorted(alone.values()).count(0.0) == 8 and sorted(alone.values()).count(1.0) == 8


def test_more_trials_than_the_fleet_holds_wait_longest_first() -> None:
    heights = {f"t{i}": float(100 + i) for i in range(20)}
    w = fill(heights, 8, SPEED)
    waiting = sorted(t for t, x in w.items() if x == 0.0)
    assert waiting == [f"t{i}" for i in range(4)]  # the four shortest wait
    decisions = plan([trial(t, h / 100) for t, h in heights.items()], FluidConfig(8, SPEED))
    waits = [d for d in decisions if d.kind == Kind.WAIT]
    assert {d.trial_id for d in waits} == set(waiting)
    assert all("larger than the fleet" in d.reason for d in waits)
    assert len(decisions) == 20  # no trial lost: each has a decision


def test_twelve_identical_trials_on_eight_gpus_share_where_it_pays() -> None:
    w = fill({f"t{i}": 1000.0 for i in range(12)}, 8, SPEED)
    assert sorted(w.values()) == [0.5] * 8 + [1.0] * 4
    assert gpu_cost(list(w.values())) == 8


def test_unmeasured_trials_profile_alone_first() -> None:
    decisions = plan([trial(f"t{i}", None) for i in range(10)], FluidConfig(8, SPEED))
    kinds = [d.kind for d in decisions]
    assert kinds == [Kind.PROFILE] * 8 + [Kind.WAIT] * 2
    assert all(d.new_width == 1.0 for d in decisions if d.kind == Kind.PROFILE)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan")])
def test_zero_or_missing_height_is_profiled_again_with_a_record(bad: float) -> None:
    running = [trial("t0", bad, width=1.0), trial("t1", 2.0, width=1.0)]
    decisions = plan(running, FluidConfig(8, SPEED))
    kept = [d for d in decisions if d.trial_id == "t0"]
    assert kept and kept[0].kind == Kind.KEEP and "no measurement" in kept[0].reason
    assert any(d.trial_id == "t1" and d.kind == Kind.RESIZE for d in decisions)


def test_dynamic_refills_running_trials_static_does_not() -> None:
    state = [trial("t0", 1.0, width=1.0), trial("t1", 3.0, width=1.0)]
    dyn = plan(state, FluidConfig(8, SPEED, dynamic=True, restart_s=10))
    assert [(d.trial_id, d.kind, d.new_width) for d in dyn] == [("t0", Kind.RESIZE, 4.0), ("t1", Kind.RESIZE, 4.0)]
    assert all(d.gain_s >= 10 for d in dyn)
    static = plan(state, FluidConfig(8, SPEED, dynamic=False, restart_s=10))
    assert [d for d in static if d.changes] == []


def test_static_fills_a_group_once_all_of_it_is_measured() -> None:
    state = [trial("t0", 1.0), trial("t1", None)]
    static = plan(state, FluidConfig(8, SPEED, dynamic=False))
    by = {d.trial_id: d for d in static}
    assert by["t1"].kind == Kind.PROFILE
    assert by["t0"].kind == Kind.WAIT and "filled once" in by["t0"].reason
    later = plan([trial("t0", 1.0), trial("t1", 3.0)], FluidConfig(8, SPEED, dynamic=False))
    assert {d.trial_id: d.new_width for d in later} == {"t0": 4.0, "t1": 4.0}


def test_a_resize_whose_gain_is_below_its_restart_cost_is_skipped() -> None:
    # 20 s of work left: widening to 4 GPUs saves 20 - 20/3.4 = 14 s, less than a 60 s restart
    state = [trial("t0", 1.0, steps=20, width=1.0)]
    skipped = plan(state, FluidConfig(8, SPEED, restart_s=60))
    assert [d.kind for d in skipped] == [Kind.KEEP] and "best gain" in skipped[0].reason
    done = plan(state, FluidConfig(8, SPEED, restart_s=2))
    assert [(d.kind, d.new_width) for d in done] == [(Kind.RESIZE, 4.0)]
    forced = plan(state, FluidConfig(8, SPEED, restart_s=60, skip_unprofitable=False))
    assert [(d.kind, d.new_width) for d in forced] == [(Kind.RESIZE, 4.0)]


def test_a_trial_without_checkpoint_is_never_resized() -> None:
    state = [trial("t0", 1.0, width=1.0, checkpointed=False)]
    decisions = plan(state, FluidConfig(8, SPEED, restart_s=0))
    assert [(d.kind, d.new_width) for d in decisions] == [(Kind.KEEP, 1.0)]
    assert "no checkpoint" in decisions[0].reason


def test_apply_steps_the_state_and_a_second_plan_is_quiet() -> None:
    state = [trial(f"t{i}", 1.0 + i) for i in range(5)]
    config = FluidConfig(8, SPEED, restart_s=0)
    after = apply(state, plan(state, config))
    assert gpu_cost([t.width for t in after]) <= 8
    assert [d for d in plan(after, config) if d.changes] == []


def test_speed_model_from_the_lucid_data() -> None:
    model = from_lucid(FLEET, "ResNet18", 64, max_share=2, max_span=4, dp_efficiency=0.85)
    assert model.max_share == 2
    assert 0.6 < model.share_speeds[1] < 0.7  # Lucid measured 0.648 / 0.652 for two ResNet18s at batch 64
    assert model.speed(2.0) == pytest.approx(1.7) and model.speed(0.5) == model.share_speeds[1]
    tight = from_lucid(FLEET, "ResNet18", 64, max_share=4, capacity=7 << 30)  # 3 GiB lanes: two fit
    assert tight.max_share == 2
    assert lanes_admitted(1 << 30, 0, 16 << 30, 8) == 8


def test_bad_settings_and_data_raise_our_error() -> None:
    with pytest.raises(InvalidInput):
        SpeedModel(dp_efficiency=1.5)
    with pytest.raises(InvalidInput):
        FluidConfig(0, SPEED)
    with pytest.raises(InvalidInput, match="no Nope"):
        from_lucid(FLEET, "Nope", 64)
    with pytest.raises(InvalidInput, match="twice"):
        plan([trial("t0", 1.0), trial("t0", 2.0)], FluidConfig(8, SPEED))
    # a trial bigger than the GPU used to get one "lane alone" (lanes_admitted's floor of 1), as if it fitted
    with pytest.raises(InvalidInput, match="more than a GPU"):
        from_lucid(FLEET, "ResNet18", 64, capacity=1 << 30)


def test_a_trial_with_no_steps_left_keeps_what_it_holds() -> None:
    state = [trial("t0", 1.0, steps=0, width=1.0), trial("t1", 2.0, steps=10, width=1.0)]
    decisions = plan(state, FluidConfig(4, SPEED, restart_s=0))
    assert [(d.trial_id, d.new_width) for d in decisions] == [("t1", 3.0)]


def test_c_and_d_are_settings(fleet_home, monkeypatch) -> None:
    monkeypatch.setenv("FLEETLENS_SWEEP_MAX_SHARE", "1")
    monkeypatch.setenv("FLEETLENS_SWEEP_MAX_SPAN", "2")
    monkeypatch.setenv("FLEETLENS_SWEEP_DYNAMIC", "false")
    config = config_from_settings(get_settings(fresh=True), 8)
    assert (config.speed.max_share, config.speed.max_span, config.dynamic) == (1, 2, False)
    assert fill({"t0": 100.0}, 8, config.speed) == {"t0": 2.0}
    assert set(fill({f"t{i}": 1.0 for i in range(12)}, 8, config.speed).values()) == {0.0, 1.0}


@pytest.mark.parametrize(("field", "value"), [("remaining_steps", float("nan")), ("remaining_steps", float("inf")),
                                              ("width", float("nan")), ("width", -0.5), ("width", float("inf"))])
def test_a_trial_state_that_is_no_state_is_refused(field: str, value: float) -> None:
    # NaN steps used to be height 0 ("no steps left": it waits, never filled); a NaN width "not running", so the
    # GPUs it holds were filled again
    with pytest.raises(InvalidInput) as exc:
        TrialState("t0", "g", **{"remaining_steps": 10.0, "width": 0.0, field: value})
    assert "'t0'" in str(exc.value) and {"remaining_steps": "steps", "width": "width"}[field] in str(exc.value)
