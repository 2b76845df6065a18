"""The distribution-aware batch scheduler (our Orloj reconstruction) as a pure policy, in the simulator on the real
Alibaba request trace, and live in the in-process request queue."""

from __future__ import annotations

import time

import numpy as np
import pytest

from enforcer.serving.distribution import Distributions, TimeGrid, batch_cost
from enforcer.serving.live import RequestQueue
from enforcer.serving.policy import DistributionAware
from enforcer.sim.serving.baselines import ClockworkLike
from enforcer.sim.serving.engine import Workload, simulate
from enforcer.sim.serving.experiment import OursTuning, prepare, run_policies, tune_ours
from enforcer.sim.serving.rightsize import prepare_workflow, rightsize
from enforcer.sim.serving.traces import RequestTrace, read_alibaba_requests, read_azure_requests
from store import latency_sketch as ls
from store.errors import InvalidInput, NotFound
from store.migrations import upgrade
from store.serving import merge_minutes, set_slo
from store.workflows import upsert_workflow
from tests.ui.serving_seed import WORKFLOW, seed_serving

DATA = "/work/shared/data/serving"


def _dists() -> Distributions:
    grid = TimeGrid.covering(10.0)
    return Distributions.fit(grid, {"short": np.full(50, 1.0), "long": np.linspace(1.0, 9.0, 50)})


def test_a_batch_time_cdf_is_the_product_of_its_members() -> None:
    d = _dists()
    long = d.index_of["long"]
    # two 'long' requests: P(max <= 5) = P(t <= 5)^2; the grid reads within one cell
    p1 = float(d.p_within(np.array([long]), np.array([5.0]))[0])
    assert p1 == pytest.approx(0.5, abs=0.03)
    pol = DistributionAware(d, alpha=0.3)
    pmax = d.cdf[long] * d.cdf[long]
    assert float(pmax[d.grid.index(5.0)]) == pytest.approx(p1 * p1)
    assert batch_cost(8, 0.3) == pytest.approx(1.9)
    assert pol.g[4] == pytest.approx(1.6)


def test_hopeless_requests_are_dropped_and_batches_stay_in_one_group() -> None:
    d = _dists()
    short, long = d.index_of["short"], d.index_of["long"]
    # four requests at t=0: a 'long' one due at 2 s (P(t <= 2) ~ 0.06 < eps 0.2), three others with room
    work = Workload(np.zeros(4), np.array([long, short, short, long]), np.array([0, 0, 1, 0]),
                    np.array([5.0, 1.0, 1.0, 2.0]), np.array([2.0, 5.0, 5.0, 20.0]))
    sel = DistributionAware(d, alpha=0.1, eps=0.2).select(0.0, {0: [0, 1, 3], 1: [2]}, work)
    assert sel.drop == [0]
    groups = {int(work.group[i]) for i in sel.batch}
    assert len(groups) == 1 and 0 not in sel.batch


def test_every_request_is_accounted_for_and_a_backwards_clock_is_refused() -> None:
    d = _dists()
    rng = np.random.default_rng(0)
    n = 400
    apps = rng.integers(0, 2, n)
    times = np.where(apps == d.index_of["long"], rng.uniform(1, 9, n), 1.0)
    arr = np.sort(rng.uniform(0, 300, n))
    work = Workload(arr, apps, rng.integers(0, 3, n), times, arr + 6.0)
    res = simulate(work, DistributionAware(d, alpha=0.1, eps=0.3), 2, 0.1, grid=d.grid)
    assert res.on_time + res.late + res.dropped + res.left_queued == n
    assert res.dropped > 0 and res.on_time > 0
    with pytest.raises(InvalidInput, match="backwards"):
        Workload(arr[::-1], apps, apps, times, arr + 6)
    with pytest.raises(InvalidInput, match="positive"):
        Workload(arr, apps, apps, times * 0, arr + 6)


@pytest.fixture(scope="module")
def alibaba():
    trace = read_alibaba_requests(DATA)
    assert trace.skipped["status_failed"] == 398 and trace.skipped["status_pending"] == 30
    assert len(trace.arrival) == 26392
    fit, score = trace.split()
    # a quarter of the scored half keeps the test short; the benchmark runs all of it
    k = len(score.arrival) // 4
    part = RequestTrace("alibaba:part", score.arrival[:k], score.app[:k], score.group[:k], score.time[:k])
    return fit, part, score


def test_on_alibaba_ours_matches_the_point_estimate_baseline_and_beats_the_non_dropping_ones(alibaba) -> None:
    fit, part, score = alibaba
    prep = prepare(fit, part)
    res = run_policies(prep, 0.8, 2.0, 0.1, 4, eps=0.8)
    ours, cw = res["ours"].finish_rate, res["clockwork_like"].finish_rate
    assert ours >= 0.98 * cw
    assert ours >= 1.5 * max(res[n].finish_rate for n in ("nexus_like", "clipper_like", "triton_like"))
    assert res["oracle"].finish_rate > ours
    assert res["ours"].ks_batch_time() <= 0.10
    # one pooled distribution for every application does worse than per-application ones
    pooled = run_policies(prep, 0.8, 2.0, 0.1, 4, which=("ours",), eps=0.8, pooled=True)["ours"]
    assert ours >= 1.1 * pooled.finish_rate
    # with every time at its application's median, distributions carry nothing: parity with Clockwork-like
    # (the whole scored half, as the benchmark: a quarter of it leaves a few hundred batches to differ on)
    fixed = prepare(fit, score, fixed_times=True)
    fr = run_policies(fixed, 0.8, 2.0, 0.1, 4, which=("ours", "clockwork_like"))
    assert fr["ours"].finish_rate == pytest.approx(fr["clockwork_like"].finish_rate, rel=0.03)


def test_on_alibaba_stopping_running_batches_finishes_more_and_its_tuning_is_chosen_on_the_fit_half(alibaba) -> None:
    fit, part, _ = alibaba
    prep = prepare(fit, part)
    plain = run_policies(prep, 0.8, 1.5, 0.1, 4, which=("ours", "clockwork_like"), eps=0.65)
    stop = run_policies(prep, 0.8, 1.5, 0.1, 4, which=("ours",), eps=0.65, stop_running=True, stop_eps=0.05)["ours"]
    assert stop.stopped > 0 and stop.on_time > plain["ours"].on_time > plain["clockwork_like"].on_time
    assert stop.on_time + stop.late + stop.dropped + stop.left_queued == stop.n
    assert stop.ks_batch_time() <= 0.10  # predictions cut at each batch's stop, as its observed time is
    fit_part = prepare(fit, RequestTrace("alibaba:fit", *(a[: len(part.arrival)] for a in
                                                          (fit.arrival, fit.app, fit.group, fit.time))))
    choices = [OursTuning(0.65, None), OursTuning(0.65, 0.05)]
    on_fit = {t: run_policies(fit_part, 0.8, 1.5, 0.1, 4, which=("ours",), **t.kwargs())["ours"].on_time
              for t in choices}
    chosen = tune_ours(fit_part, 0.8, 1.5, 0.1, 4, eps_choices=(0.65,), stop_choices=(None, 0.05))
    assert on_fit[chosen] == max(on_fit.values())


def test_azure_times_come_from_the_stated_token_model() -> None:
    t = read_azure_requests(DATA, "code")
    assert len(t.time) == 8819 and "generated" in t.notes["token_to_time"]
    assert np.all(t.time > 0) and np.all(np.diff(t.arrival) >= 0)


def test_live_queue_sheds_hopeless_requests_and_serves_by_deadline() -> None:
    now = [100.0]
    d = _dists()
    q = RequestQueue(d, {"short": 5.0, "long": 3.0}, alpha=0.1, eps=0.3, clock=lambda: now[0])
    a = q.submit("long", "a")
    b = q.submit("short", "b")
    now[0] += 2.5  # "long" now has 0.5 s left: hopeless; "short" (1 s, 2.5 s left) can still make it
    batch = q.next_batch(timeout=0)
    assert [r.payload for r in batch.requests] == ["b"]
    assert [r.id for r in q.dropped()] == [a.id] and b.id not in [r.id for r in q.dropped()]
    assert q.submitted == q.served + q.shed + q.pending() == 2
    with pytest.raises(InvalidInput, match="unknown application"):
        q.submit("nope")
    assert q.next_batch(timeout=0.01) is None


def test_live_queue_tells_the_serving_loop_when_to_give_a_batch_up_and_counts_what_it_gives_up() -> None:
    now = [100.0]
    d = _dists()  # "long": uniform over 1-9 s
    q = RequestQueue(d, {"long": 5.0}, alpha=0.1, eps=0.3, stop_running=True, stop_eps=0.1, clock=lambda: now[0])
    a = q.submit("long", "a")
    batch = q.next_batch(timeout=0)
    # given that it is still running, its chance of being done by 105 falls below 0.1 shortly before 105
    assert batch.requests == [a] and batch.stop_at is not None and 104.0 < batch.stop_at < 105.0
    assert q.dropped() == [] and not q.past_stop(batch)
    now[0] = batch.stop_at
    assert q.past_stop(batch)
    q.stop(batch)
    assert [r.id for r in q.dropped()] == [a.id]
    assert (q.stopped, q.shed, q.served, q.pending()) == (1, 1, 0, 0)
    with pytest.raises(InvalidInput, match="already given up"):  # counted once, however often the loop says so
        q.stop(batch)
    assert (q.stopped, q.shed, q.served) == (1, 1, 0) and q.dropped() == []
    assert q.submitted == q.served + q.shed + q.pending()
    plain = RequestQueue(d, {"long": 5.0}, alpha=0.1, eps=0.3, clock=lambda: now[0])
    plain.submit("long")
    unstoppable = plain.next_batch(timeout=0)
    now[0] += 1e6
    assert unstoppable.stop_at is None and not plain.past_stop(unstoppable)
    # a stop threshold above the drop threshold would keep requests the stop rule gives up as they start: refused
    for stop_eps in (0.5, 0.0):
        with pytest.raises(InvalidInput, match="0 < stop_eps <= eps"):
            RequestQueue(d, {"long": 5.0}, alpha=0.1, eps=0.3, stop_running=True, stop_eps=stop_eps)
    assert RequestQueue(d, {"long": 5.0}, alpha=0.1, eps=0.3, stop_eps=0.5).policy.stop_eps == 0.5  # not stopping


def test_rightsize_of_a_stored_serving_workflow(any_store) -> None:
    upgrade(any_store)
    seed_serving(any_store)
    prep, slo, held = prepare_workflow(any_store, WORKFLOW)
    assert held == 4 and len(prep.arrival) == 20 * 60 + 8
    rs = rightsize(prep, slo, target=0.9, max_gpus=8)
    assert rs.best is not None and rs.best[1] < held
    assert rs.needed["ours"] is not None and rs.needed["ours"] <= rs.needed["nexus_like"]
    # each way of having nothing to size says which it is
    with pytest.raises(NotFound, match="no workflow 'no-such-service' in the store"):
        prepare_workflow(any_store, "no-such-service")
    with any_store.session() as s:
        upsert_workflow(s, "a-training-job")
    with pytest.raises(NotFound, match="'a-training-job' has recorded no serving requests"):
        prepare_workflow(any_store, "a-training-job")
    later = time.time() + 3 * 3600.0
    with pytest.raises(NotFound, match="no requests in the last 3600 s; the newest .* --window 1[01][0-9]{3} ") as e:
        prepare_workflow(any_store, WORKFLOW, now=later)
    window = float(str(e.value).split("--window ")[1].split()[0])
    # the window it names reaches the newest minute, and no shorter one does
    assert len(prepare_workflow(any_store, WORKFLOW, now=later, window_s=window)[0].arrival) > 0
    with pytest.raises(NotFound):
        prepare_workflow(any_store, WORKFLOW, now=later, window_s=window - 61.0)


def test_a_running_batch_that_can_no_longer_make_it_is_stopped_and_counted() -> None:
    d = _dists()
    long = d.index_of["long"]
    n = 200
    rng = np.random.default_rng(3)
    arr = np.sort(rng.uniform(0, 400, n))
    times = rng.uniform(1, 9, n)
    work = Workload(arr, np.full(n, long), np.zeros(n, dtype=np.int64), times, arr + 5.0)
    pol = DistributionAware(d, alpha=0.1, eps=0.2, stop_running=True, stop_eps=0.1)
    res = simulate(work, pol, 1, 0.1, grid=d.grid)
    plain = simulate(work, DistributionAware(d, alpha=0.1, eps=0.2), 1, 0.1)
    assert res.stopped > 0 and res.stopped <= res.dropped
    # the predicted batch-time CDF, cut at each batch's stop as its observed time is, matches the simulated times
    assert res.ks_batch_time() < 0.1
    assert res.on_time + res.late + res.dropped + res.left_queued == n
    # a stopped batch frees the device for requests that can still make it (here: at least as many on time)
    assert res.busy_gpu_s < plain.busy_gpu_s and res.on_time >= plain.on_time
    # the point-estimate baseline stops a batch once all its members are late: one at a time, none ends late
    cw = simulate(work, ClockworkLike(d.mean, 0.1, max_batch=1, stop_running=True), 1, 0.1)
    assert cw.late == 0 and cw.stopped > 0


def test_stopping_with_the_default_thresholds_is_accepted_and_stop_eps_defaults_to_eps() -> None:
    d = _dists()
    q = RequestQueue(d, {"long": 5.0}, alpha=0.1, stop_running=True)
    assert q.policy.stop_eps == q.policy.eps
    assert DistributionAware(d, alpha=0.1, eps=0.3, stop_running=True).stop_eps == 0.3
    # given explicitly, as the simulator and the benchmark do, it is kept
    assert DistributionAware(d, alpha=0.1, eps=0.3, stop_running=True, stop_eps=0.1).stop_eps == 0.1


@pytest.mark.parametrize("kwargs, match", [
    ({"alpha": -0.5}, "alpha=-0.5"),
    ({"alpha": float("nan")}, "alpha=nan"),
    ({"alpha": float("inf")}, "alpha=inf"),
    ({"alpha": 0.1, "eps": 1.0}, "eps=1.0"),
    ({"alpha": 0.1, "eps": -0.1}, "eps=-0.1"),
    ({"alpha": 0.1, "eps": float("nan")}, "eps=nan"),
    ({"alpha": 0.1, "max_batch": 0}, "max_batch=0"),
    ({"alpha": 0.1, "max_batch": 2.5}, "max_batch=2.5"),
    ({"alpha": 0.1, "lookahead": 0}, "lookahead=0"),
    ({"alpha": 0.1, "stop_running": True, "stop_eps": float("nan")}, "stop_eps=nan"),
])
def test_the_scheduler_refuses_parameters_it_cannot_plan_with(kwargs, match) -> None:
    d = _dists()
    with pytest.raises(InvalidInput, match=match):
        DistributionAware(d, **kwargs)
    if "lookahead" not in kwargs:  # the live queue takes the policy's other parameters as they are
        with pytest.raises(InvalidInput, match=match):
            RequestQueue(d, {"long": 5.0}, **kwargs)


def test_the_live_queue_reuses_the_slots_of_requests_that_left_and_chooses_the_same_batches() -> None:
    d = _dists()
    slos = {"short": 4.0, "long": 6.0}
    rng = np.random.default_rng(7)
    now = [0.0]
    q = RequestQueue(d, slos, alpha=0.1, eps=0.3, max_batch=4, groups={"short": "m", "long": "m"},
                     clock=lambda: now[0])
    # the same arrivals replayed through the policy over arrays that keep every request ever submitted
    pol = DistributionAware(d, alpha=0.1, eps=0.3, max_batch=4)
    n = 3000
    app = np.zeros(n, dtype=np.int64)
    deadline = np.zeros(n)
    work = Workload(np.zeros(n), app, np.zeros(n, dtype=np.int64), np.ones(n), deadline)
    waiting: list[int] = []
    ids = 0
    for _ in range(600):
        for _ in range(int(rng.integers(0, 6))):
            name = "short" if rng.random() < 0.6 else "long"
            r = q.submit(name, ids)
            app[ids], deadline[ids] = d.index_of[name], r.deadline
            waiting.append(ids)
            ids += 1
        now[0] += float(rng.uniform(0.0, 1.5))
        expect = pol.select(now[0], {0: waiting} if waiting else {}, work)
        waiting = [i for i in waiting if i not in set(expect.batch) | set(expect.drop)]
        batch = q.next_batch(timeout=0)
        assert [r.payload for r in q.dropped()] == expect.drop
        assert (batch.payloads if batch else []) == expect.batch
    assert ids > 1000 and q.submitted == q.served + q.shed + q.pending() == ids
    assert q.served > 0 and q.shed > 0
    # the arrays hold the requests waiting at once (a few dozen at most here), not all that were ever submitted
    assert len(q._view.app) <= 128


def _minute(app: str, minute: float, n: int, dropped: int, t: float = 0.3) -> dict:
    eh: dict[int, int] = {}
    if n:
        ls.add(eh, t, n)
    return {"app": app, "minute": minute, "n": n, "dropped": dropped, "met": n, "exec_sum": n * t,
            "exec_sumsq": n * t * t, "wait_sum": 0.0, "latency_sum": n * t, "batch_sum": n,
            "exec_hist": ls.to_json(eh), "latency_hist": ls.to_json(eh)}


def test_rightsize_counts_shed_requests_as_load_and_refuses_an_application_it_cannot_time(sqlite_store) -> None:
    now = time.time()
    seed_serving(sqlite_store, now=now)
    minute = now // 60 * 60
    # "upscale" was served three hours ago; in the last hour every one of its requests was shed
    with sqlite_store.session() as s:
        set_slo(s, WORKFLOW, "upscale", 1.0)
        merge_minutes(s, WORKFLOW, [_minute("upscale", minute - 3 * 3600.0, 30, 0)]
                      + [_minute("upscale", minute - 60.0 * (i + 1), 0, 50) for i in range(10)], devices=4)
    with pytest.raises(InvalidInput, match=r"every request of 'upscale' \(500\) in the last 3600 s was shed") as e:
        prepare_workflow(sqlite_store, WORKFLOW, now=now)
    window = float(str(e.value).split("--window ")[1].split()[0])
    assert 3 * 3600 <= window <= 3 * 3600 + 120
    # with a window that reaches its served minute, its shed requests are replayed as load, as the others' are
    prep, _, _ = prepare_workflow(sqlite_store, WORKFLOW, now=now, window_s=window)
    assert int(np.sum(np.array(prep.apps)[prep.app] == "upscale")) == 30 + 500
    assert len(prep.arrival) == 20 * 60 + 8 + 30 + 500
    # a workflow that has only ever shed its requests says so, not that it has none in the window
    with sqlite_store.session() as s:
        upsert_workflow(s, "overloaded")
        set_slo(s, "overloaded", "a", 0.1)
        merge_minutes(s, "overloaded", [_minute("a", minute - 600.0, 0, 5000)], devices=2)
    with pytest.raises(InvalidInput, match=r"'a' \(5000\) .* shed.* no request of \['a'\] was ever served"):
        prepare_workflow(sqlite_store, "overloaded", now=now)
