"""The sweep simulator on the real benchmark tables: Fluid against one trial per GPU, and the skip rule."""

from __future__ import annotations

import statistics

import pytest

from enforcer.sim.sweeps.compare import compare
from enforcer.sim.sweeps.data import load
from enforcer.sim.sweeps.engine import Engine
from enforcer.sim.sweeps.tune_model import place, release, run_tune_model
from enforcer.sim.sweeps.tuners import make_tuner
from enforcer.sweeps.fluid import FluidConfig
from enforcer.sweeps.speed import SpeedModel
from store.errors import InvalidInput

SPEED = SpeedModel(dp_efficiency=0.85, share_speeds=(1.0, 0.65), max_span=4)


def test_tables_come_from_the_installed_package() -> None:
    nas, hpo = load("nasbench201"), load("hpolib")
    assert len(nas) == 15625 and 540 < nas.train_s.min() < nas.train_s.max() < 3500
    assert len(hpo) == 62208 and 60 < hpo.train_s.min() < hpo.train_s.max() < 2300
    with pytest.raises(InvalidInput):
        load("mnist")


def test_sync_halving_gains_from_data_parallel_last_rungs() -> None:
    cmp = compare("sha", load("nasbench201"), [0, 1], SPEED, 8, 10.0)
    assert min(cmp.speedups("dynamic")) > 1.5
    assert cmp.late_gain_points("dynamic") > 20  # the last rungs' idle GPUs are used


def test_skipping_unprofitable_resizes_helps_on_short_rounds() -> None:
    cmp = compare("sha", load("hpolib"), [0, 1], SPEED, 8, 10.0)
    assert statistics.median(cmp.speedups("dynamic")) > statistics.median(cmp.speedups("dynamic_noskip")) + 0.2


def test_identical_trials_never_lose_to_one_per_gpu_even_at_60s_restarts() -> None:
    cmp = compare("identical", load("hpolib"), [0, 1, 2], SPEED, 8, 60.0)
    assert min(cmp.speedups("dynamic")) >= 0.98


def test_every_trial_finishes_and_the_gpus_are_never_overcommitted() -> None:
    tuner = make_tuner("asha", load("nasbench201"), 3)
    run = Engine(tuner, 8, SPEED, FluidConfig(8, SPEED, restart_s=10.0), 10.0).run()
    assert all(held <= 8 for _, _, held, _ in run.timeline)
    assert run.makespan >= run.work_s / 8 / 0.65 * 0.5  # sharing can beat sum/G, never by that much
    started = {r.trial_id for r in run.reallocations}
    assert started == {f"t-{i}" for i in range(81)}


def test_the_model_of_ray_tune_hands_widths_out_at_results() -> None:
    """b is measured first and widens while a profiles; a's measurement makes b give GPUs back at its next result,
    and a widens only at its own next result, once they are free."""
    config = FluidConfig(4, SPEED, restart_s=1.0)
    ctrl = run_tune_model([("a", 2.0, 5), ("b", 1.0, 3)], config, start_s=1.0, restart_s=1.0, max_t=5)
    assert ctrl.sequence() == [("b", 1.0, 3.0), ("b", 3.0, 1.0), ("a", 1.0, 3.0)]
    kinds = [(e.trial_id, e.kind) for e in ctrl.events]
    assert kinds[:2] == [("b", "start"), ("b", "resize")] and kinds.count(("a", "finish")) == 1
    assert [r.seq for r in ctrl.log] == [0, 1, 2] and ctrl.log[1].at < ctrl.log[2].at


@pytest.mark.parametrize("sequential", [False, True])
def test_hyperband_runs_its_brackets_together_or_one_after_the_other(sequential: bool) -> None:
    tuner = make_tuner("hyperband_seq" if sequential else "hyperband", load("hpolib"), 1)
    first = tuner.start()
    assert len(first) == (81 if sequential else 81 + 34 + 15 + 8 + 5)  # ceil(5 / (s + 1) * 3^s), s = 4 .. 0
    released = {r.trial_id for r in first}
    # play bracket s = 4 to its end: each rung's trials finish, the best third are promoted
    rung = [r.trial_id for r in first if r.group == "b4-rung-0"]
    later: list = []
    while rung:
        promoted = []
        for t in rung:
            go_on, out = tuner.round_done(t, 0)
            assert go_on is None
            promoted += [r.trial_id for r in out if r.resume]
            later += [r for r in out if not r.resume]
        assert len(promoted) in (0, len(rung) // 3)
        rung = promoted
    assert len(later) == (34 if sequential else 0)  # the next bracket starts only when this one is done
    assert not released & {r.trial_id for r in later}


def test_the_model_of_ray_tune_retries_a_trial_that_died_with_the_gpus_it_held() -> None:
    """Ray keeps a resized trial's placement group on a retry: b dies on 4 GPUs and comes back on 4."""
    config = FluidConfig(4, SPEED, restart_s=1.0)
    ctrl = run_tune_model([("b", 12.0, 5)], config, start_s=2.0, restart_s=3.0, max_t=5, fail_at={"b": 2})
    assert ctrl.sequence() == [("b", 1.0, 4.0)]  # no second resize: it came back where it was
    kinds = [(e.kind, e.old_width, e.new_width) for e in ctrl.events]
    assert kinds == [("start", 0.0, 1.0), ("resize", 1.0, 4.0), ("died", 4.0, 0.0), ("start", 0.0, 4.0),
                     ("finish", 4.0, 0.0)]


def test_the_model_places_bundles_as_rays_raylet_does() -> None:
    """Whole GPUs: the first that hold nothing; a fraction: the GPU it fits most tightly (the reviewer's runs on
    Ray 2.60: halves a and b share GPU 0, c goes to GPU 1; with b gone, three whole GPUs do not fit)."""
    free = [1.0] * 4
    a, b, c = place(free, 0.5), place(free, 0.5), place(free, 0.5)
    assert (a, b, c) == ((0,), (0,), (1,))
    release(free, 0.5, b)
    assert place(list(free), 3.0) is None and place(list(free), 2.0) == (2, 3)
    assert place(free, 0.5) == (0,)  # the tightest fit, not the first GPU with room
    mixed = [1.0, 1.0]
    assert [place(mixed, w) for w in (1 / 2, 1 / 3, 1 / 3, 1 / 2, 1 / 3)] == [(0,), (0,), (1,), (1,), None]
