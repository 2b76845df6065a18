"""Which trial Ray Tune starts between results (FluidScheduler.choose_trial_to_run), on Ray's own Trial objects and
its ASHA scheduler, without a cluster: Ray's TuneController is stood in for by the one call a scheduler may make of
it (get_trials), and each trial's status is set as Ray sets it."""

from __future__ import annotations

import itertools

import pytest

from enforcer.sweeps.fluid import FluidConfig
from enforcer.sweeps.speed import SpeedModel
from tests.sweeps.needs_ray import need_ray

SPEED = SpeedModel(dp_efficiency=0.85, share_speeds=(1.0, 0.65), max_span=4)


EXPERIMENT: dict[str, object] = {}  # the Ray Tune experiment the trials of a test belong to (`trial`)


@pytest.fixture(autouse=True)
def _ray_tune(tmp_path) -> None:
    need_ray()
    experiment(str(tmp_path), "fluid-sweep")


def experiment(storage_path: str, name: str) -> None:
    """The experiment `trial` puts trials in from now: Ray gives every trial of one Tuner run a copy of the run's
    StorageContext (its experiment_dir_name is the run's name)."""
    from ray.train._internal.storage import StorageContext

    EXPERIMENT["storage"] = StorageContext(storage_path, name)
    EXPERIMENT["count"] = 0


class Tune:
    """Ray's TuneController as a scheduler sees it (TrialRunnerWrapper lets it call get_trials), its trials listed
    in the order given."""

    def __init__(self, *trials: object) -> None:
        self.trials = list(trials)

    def get_trials(self) -> list:
        return self.trials


def scheduler(gpus: int):
    from collector.tune.scheduler import FluidScheduler, base_scheduler

    base = base_scheduler("asha", metric="loss", mode="min", max_t=100, grace_period=100)  # never stops a trial
    return FluidScheduler(base, FluidConfig(gpus, SPEED, dynamic=True, restart_s=0.0))


def trial(sched, trial_id: str, width: float | None = None, status: str = "PENDING"):
    """A Ray trial the scheduler was told of (on_trial_add), with `status` and the placement group of `width` GPUs
    (default: the one every trial starts with; another width is set as Ray's ResourceChangingScheduler resizes). Made
    as Ray's BasicVariantGenerator makes it: a tag of its own ("0_name=a") and its experiment's storage."""
    from ray.tune.experiment import Trial

    from collector.tune.scheduler import bundle

    n = EXPERIMENT["count"]
    EXPERIMENT["count"] = n + 1
    t = Trial("fluid", stub=True, trial_id=trial_id, experiment_tag=f"{n}_name={trial_id}",
              storage=EXPERIMENT["storage"], placement_group_factory=sched.initial_resources())
    t.create_placement_group_factory()
    sched.on_trial_add(None, t)
    if width is not None:
        sched.set_trial_resources(t, bundle(width, sched.cpu_per_trial))
    if status != Trial.PENDING:
        t.set_status(status)
    return t


def report(sched, tune: Tune, t, step_s: float, steps_left: float, gpu: int | None = None) -> str:
    """A result of a running trial, with a checkpoint; the scheduler's decision (PAUSE: it is resized)."""
    from ray.tune.result import SHOULD_CHECKPOINT

    from collector.tune.scheduler import GPU_IDS, STEP_S, STEPS_LEFT

    result = {STEP_S: step_s, STEPS_LEFT: steps_left, GPU_IDS: [] if gpu is None else [gpu], "node_ip": "n",
              SHOULD_CHECKPOINT: True, "training_iteration": 1, "loss": 1.0}
    return sched.on_trial_result(tune, t, result)


def test_a_trial_ray_is_about_to_start_is_counted_before_a_growth_is_handed_out() -> None:
    """Halves a (GPU 0), b and c (GPU 1) on 2 GPUs; p waits (the plan has no whole GPU for it). The plan grows a to
    GPU 0; but Ray requests p's placement group itself and gives it GPU 0 once a pauses, so a could not be placed.
    Chosen to run between results, p is counted at its width, and the growth waits."""
    sched = scheduler(2)
    a, b, c = (trial(sched, t, 0.5, "RUNNING") for t in "abc")
    tune = Tune(a, b, c)
    for t, step_s, gpu in ((a, None, 0), (c, None, 1), (b, 1.0, 1), (c, 1.0, 1)):  # a and c profile, then measured
        assert report(sched, tune, t, step_s, 10, gpu) == "CONTINUE"
    p = trial(sched, "p")  # the searcher releases p between results
    tune.trials.append(p)
    assert sched.choose_trial_to_run(tune) is p  # Ray starts it as soon as a GPU is free
    assert report(sched, tune, a, 10.0, 10, 0) == "CONTINUE"  # a's measurement
    assert sched.controller.planned["a"].new_width == 1.0  # the growth the plan wants is not handed out:
    assert sched.controller.held("a") == 2  # b and c on GPU 1, p on a GPU of its own
    assert sched.controller.planned["p"].kind == "wait"
    assert sched.log == [] and a not in sched._trials_to_reallocate and not sched.controller.promised


def test_a_trial_waits_for_the_gpus_of_a_growth_until_it_is_placed() -> None:
    """On 4 GPUs a grows to 3 while b profiles on the fourth. p comes while a is paused to resize: p would take a
    GPU a was promised, so Ray is told to start nothing until a runs on its 3 GPUs; a's growth goes first (ASHA would
    put it behind p, every PENDING trial before any PAUSED one), then p."""
    sched = scheduler(4)
    a, b = trial(sched, "a"), trial(sched, "b")
    tune = Tune(a, b)
    assert sched.choose_trial_to_run(tune) is a
    for t in (a, b):
        t.set_status("RUNNING")  # Ray placed both
    assert report(sched, tune, a, 2.0, 9, 0) == "PAUSE"  # grows to 3: b counted on one GPU
    assert sched.log[-1].new_width == 3.0 and a in sched._trials_to_reallocate
    p = trial(sched, "p")
    tune.trials.append(p)
    assert sched.choose_trial_to_run(tune) is None  # a still saves its checkpoint: p waits
    a.set_status("PAUSED")
    assert sched.choose_trial_to_run(tune) is a  # its new placement group is requested before p's
    assert a.placement_group_factory.required_resources["GPU"] == 3.0
    a.set_status("PENDING")  # staged: Ray waits for its 3 GPUs
    assert sched.choose_trial_to_run(tune) is a
    a.set_status("RUNNING")  # placed
    assert sched.choose_trial_to_run(tune) is p  # the growth is placed: p starts when a GPU frees
    assert not sched.controller.promised
    assert sched.controller.held() == 5  # a 3, b 1, p 1: no growth is handed out before p runs


def test_a_growth_given_up_no_longer_holds_a_trial_back() -> None:
    sched = scheduler(4)
    a, b = trial(sched, "a", status="RUNNING"), trial(sched, "b", status="RUNNING")
    tune = Tune(a, b)
    assert report(sched, tune, a, 2.0, 9, 0) == "PAUSE"
    p = trial(sched, "p")
    tune.trials.append(p)
    assert sched.choose_trial_to_run(tune) is None
    a.set_status("ERROR")
    sched.on_trial_error(tune, a)  # a died before it was placed: its growth is given up
    assert sched.choose_trial_to_run(tune) is p


@pytest.mark.parametrize("order", list(itertools.permutations("ap")))
@pytest.mark.parametrize("growing", ["PAUSED", "PENDING"])
def test_with_nothing_running_a_trial_always_starts_the_growth_first(order: tuple[str, ...], growing: str) -> None:
    """Nothing runs: a's growth to 2 GPUs of 2 is paused (or staged and not placed), and p, released after it, would
    take a GPU of it: whatever order Ray lists them in, the answer is a trial, never None (staged, a's growth holds
    nothing back); a paused growth is that trial (ASHA alone would pick p)."""
    sched = scheduler(2)
    a = trial(sched, "a", status="RUNNING")
    assert report(sched, Tune(a), a, 2.0, 9, 0) == "PAUSE"
    assert sched.log[-1].new_width == 2.0
    a.set_status("PAUSED")
    p = trial(sched, "p")
    tune = Tune(*({"a": a, "p": p}[t] for t in order))
    chosen = sched.choose_trial_to_run(tune)  # gives a its placement group of 2 GPUs
    assert chosen is a
    if growing == "PENDING":
        a.set_status("PENDING")
        chosen = sched.choose_trial_to_run(tune)
        assert chosen is not None
        assert chosen is a or order.index("p") < order.index("a")  # ASHA's own pick: the first PENDING trial
