"""One serving experiment: fit per-application distributions on the first half of a request trace, compress the
second half's arrivals to a target load on `n_gpus` devices, and replay it under our reconstruction, the
baselines and the oracle. What the benchmark, the right-sizing answer and the tests call."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from enforcer.serving.distribution import Distributions, TimeGrid
from enforcer.serving.policy import DEFAULT_EPS, DEFAULT_MAX_BATCH, DistributionAware
from enforcer.sim.serving.baselines import ClipperLike, ClockworkLike, NexusLike, Oracle, TritonLike
from enforcer.sim.serving.engine import SimResult, Workload, simulate
from enforcer.sim.serving.traces import RequestTrace
from store.errors import InvalidInput

MIN_FIT = 20  # an application with fewer fit requests borrows its model's, else the pooled distribution
NON_DROPPING = ("nexus_like", "clipper_like", "triton_like")
DROPPING = ("clockwork_like",)
TRITON_DELAY_OF_MEDIAN = 0.25
GRID_QUANTILE = 0.999


@dataclass
class Prepared:
    """Distributions fit on one half, the other half's requests mapped onto them."""

    apps: list[str]
    groups: list[str]
    dists: Distributions
    pooled: Distributions
    app: np.ndarray
    group: np.ndarray
    arrival: np.ndarray
    time: np.ndarray
    fallback: Counter = field(default_factory=Counter)
    time_basis: dict[str, str] = field(default_factory=dict)  # application -> where its times came from, if said

    @property
    def span(self) -> float:
        return float(self.arrival[-1] - self.arrival[0]) if len(self.arrival) > 1 else 0.0


def prepare(fit: RequestTrace, score: RequestTrace, *, fixed_times: bool = False) -> Prepared:
    """Per-application samples from `fit` (an application seen fewer than MIN_FIT times there takes its model's
    samples, else every sample: counted in `fallback`). With `fixed_times`, every request of both halves takes
    its application's fit median: the control where distributions carry nothing a point estimate does not."""
    if len(fit.time) == 0 or len(score.time) == 0:
        raise InvalidInput("serving experiment: both halves of the trace need requests")
    apps = sorted(set(score.app.tolist()))
    groups = sorted(set(score.group.tolist()))
    by_app = {a: fit.time[fit.app == a] for a in set(fit.app.tolist())}
    by_group = {g: fit.time[fit.group == g] for g in set(fit.group.tolist())}
    samples: dict[str, np.ndarray] = {}
    fallback: Counter = Counter()
    group_of_app = dict(zip(score.app.tolist(), score.group.tolist(), strict=False))
    for a in apps:
        if a in by_app and by_app[a].size >= MIN_FIT:
            samples[a] = by_app[a]
        elif group_of_app[a] in by_group and by_group[group_of_app[a]].size >= MIN_FIT:
            samples[a], fallback["model"] = by_group[group_of_app[a]], fallback["model"] + 1
        else:
            samples[a], fallback["pooled"] = fit.time, fallback["pooled"] + 1
    app_idx = {a: i for i, a in enumerate(apps)}
    app = np.array([app_idx[a] for a in score.app.tolist()], dtype=np.int64)
    time = score.time.astype(float)
    if fixed_times:
        med = {a: float(np.median(s)) for a, s in samples.items()}
        samples = {a: np.array([m]) for a, m in med.items()}
        time = np.array([med[apps[i]] for i in app])
    # The grid spans the 99.9th percentile of the times (longer ones share its last cell): the CDF is read to
    # within one cell, and a cell of a tenth of the longest time would blur the tails a deadline is judged on.
    grid = TimeGrid.covering(float(np.quantile(np.concatenate([fit.time, time]), GRID_QUANTILE)))
    dists = Distributions(grid, apps, [samples[a] for a in apps])
    pool = np.concatenate([samples[a] for a in apps]) if fixed_times else fit.time
    pooled = Distributions(grid, ["pooled"], [pool])
    group_idx = {g: i for i, g in enumerate(groups)}
    group = np.array([group_idx[g] for g in score.group.tolist()], dtype=np.int64)
    return Prepared(apps, groups, dists, pooled, app, group, score.arrival.astype(float), time, fallback)


def compress(prep: Prepared, load: float, n_gpus: int) -> tuple[np.ndarray, float]:
    """Arrivals (from 0) squeezed so the requests' time alone fills `load` of `n_gpus` devices; and the factor."""
    if not 0 < load:
        raise InvalidInput(f"load={load}: must be positive")
    work = float(prep.time.sum())
    target_span = work / (n_gpus * load)
    factor = prep.span / target_span if target_span > 0 else 1.0
    return (prep.arrival - prep.arrival[0]) / factor, factor


def workload(prep: Prepared, load: float, n_gpus: int, k: float) -> tuple[Workload, np.ndarray]:
    arrival, _ = compress(prep, load, n_gpus)
    slo = k * prep.dists.median
    return Workload(arrival, prep.app, prep.group, prep.time, arrival + slo[prep.app]), slo


def group_stats(prep: Prepared, slo: np.ndarray) -> tuple[dict[int, float], dict[int, float], dict[int, float]]:
    """Per batching group: the largest mean time of its applications, the smallest SLO, the smallest median."""
    mean, gslo, med = {}, {}, {}
    for g in range(len(prep.groups)):
        apps = np.unique(prep.app[prep.group == g])
        mean[g] = float(prep.dists.mean[apps].max())
        gslo[g] = float(slo[apps].min())
        med[g] = float(prep.dists.median[apps].min())
    return mean, gslo, med


def run_policies(prep: Prepared, load: float, k: float, alpha: float, n_gpus: int, *,
                 which: tuple[str, ...] = ("ours", "clockwork_like", "nexus_like", "clipper_like", "triton_like",
                                           "oracle"),
                 eps: float = DEFAULT_EPS, max_batch: int = DEFAULT_MAX_BATCH, pick: str = "edf",
                 pooled: bool = False, **ours_kw) -> dict[str, SimResult]:
    work, slo = workload(prep, load, n_gpus, k)
    return simulate_policies(prep, work, slo, alpha, n_gpus, which=which, eps=eps, max_batch=max_batch,
                             pick=pick, pooled=pooled, **ours_kw)


def simulate_policies(prep: Prepared, work: Workload, slo: np.ndarray, alpha: float, n_gpus: int, *,
                      which: tuple[str, ...], eps: float = DEFAULT_EPS, max_batch: int = DEFAULT_MAX_BATCH,
                      pick: str = "edf", pooled: bool = False, **ours_kw) -> dict[str, SimResult]:
    """Each named scheduler on `work` (deadlines already set from `slo`, one per application)."""
    gmean, gslo, gmed = group_stats(prep, slo)
    out: dict[str, SimResult] = {}
    for name in which:
        if name == "ours":
            if pooled:
                pol = DistributionAware(prep.pooled, alpha, eps=eps, max_batch=max_batch, pick=pick,
                                        app_row=np.zeros(len(prep.apps), dtype=np.int64), **ours_kw)
            else:
                pol = DistributionAware(prep.dists, alpha, eps=eps, max_batch=max_batch, pick=pick, **ours_kw)
            out[name] = simulate(work, pol, n_gpus, alpha, grid=prep.dists.grid)
            continue
        pol = {
            "clockwork_like": lambda: ClockworkLike(prep.dists.mean, alpha, max_batch),
            "clockwork_like_stopping": lambda: ClockworkLike(prep.dists.mean, alpha, max_batch, stop_running=True),
            "oracle": lambda: Oracle(prep.time, alpha, max_batch),
            "nexus_like": lambda: NexusLike(gmean, gslo, alpha, max_batch),
            "clipper_like": lambda: ClipperLike(gslo, max_batch),
            "triton_like": lambda: TritonLike({g: TRITON_DELAY_OF_MEDIAN * m for g, m in gmed.items()}, max_batch),
        }[name]()
        out[name] = simulate(work, pol, n_gpus, alpha)
    return out


EPS_CHOICES = (0.5, 0.65, 0.8)
STOP_EPS_CHOICES = (0.05, 0.1)  # when running batches may be stopped


@dataclass(frozen=True)
class OursTuning:
    """Our scheduler's two thresholds, chosen on the fit half: the queue's drop threshold `eps` and the running
    batch's stop threshold `stop_eps` (None: never stop one)."""

    eps: float
    stop_eps: float | None

    def kwargs(self) -> dict:
        if self.stop_eps is None:
            return {"eps": self.eps}
        return {"eps": self.eps, "stop_running": True, "stop_eps": self.stop_eps}


def tune_ours(fit_prep: Prepared, load: float, k: float, alpha: float, n_gpus: int, *, pooled: bool = False,
              eps_choices: tuple[float, ...] = EPS_CHOICES,
              stop_choices: tuple[float | None, ...] = (None,)) -> OursTuning:
    """The thresholds that finish most requests on time when the fit half itself is replayed at the same load.
    With `stop_choices` (None only) a running batch is never stopped. Each threshold trades a hopeless request's GPU
    time against the requests behind it, which depends on the load; they are chosen on the data the distributions
    came from, never on the half being scored."""
    best = None
    for eps in eps_choices:
        for stop_eps in stop_choices:
            tuning = OursTuning(eps, stop_eps)
            r = run_policies(fit_prep, load, k, alpha, n_gpus, which=("ours",), pooled=pooled,
                             **tuning.kwargs())["ours"]
            if best is None or r.on_time > best[0]:
                best = (r.on_time, tuning)
    return best[1]
