"""Right-sizing a serving workflow: the fewest devices on which its measured arrivals and execution-time
distributions meet every application's SLO for at least `target` of requests, per scheduler (ours, the
reconstruction of Orloj's, and the simulator's Clockwork-, Nexus-, Clipper- and Triton-like baselines).

Two sources: a serving workflow in the store (its per-minute histograms: each minute's requests at seeded random
times within it, one batching group per application, and per-request times drawn from the distribution recovered
from its batch times per batch-size class (enforcer.serving.alone_times, with the same g as the simulator): the SDK
measures batch times, and the simulator applies g(|B|) to the batches it forms; an application whose minutes in the
window were all stored before revision 0016 keeps no batch sizes, so its batch times over all sizes are used, which
overstates the devices needed, and `Prepared.time_basis` says so), and a request
trace (Alibaba's, with real arrivals and times: distributions fit on the first half, the second half replayed at
its real pace). A target no number of devices can meet (requests that run longer than their SLO even alone) is
said so, with the best attainment any number reaches. Shed requests arrived too, so they are replayed as load; an
application whose every request in the window was shed has no execution time measured there, and is refused by
name (with the window that would reach its last served minute), not left out.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from enforcer.serving.alone_times import alone_samples
from enforcer.serving.distribution import Distributions, TimeGrid
from enforcer.sim.serving.engine import Workload
from enforcer.sim.serving.experiment import Prepared, simulate_policies
from store import latency_sketch as ls
from store.db import Store
from store.errors import InvalidInput, NotFound
from store.serving import AppWindow, app_windows, last_request_minute
from store.workflows import get_workflow

SCHEDULERS = ("ours", "clockwork_like", "nexus_like", "clipper_like", "triton_like")
RIGHTSIZE_EPS = 0.65


@dataclass
class RightSize:
    target: float
    ceiling: float  # attainment with unlimited devices (requests no longer than their SLO alone)
    needed: dict[str, int | None] = field(default_factory=dict)  # scheduler -> fewest devices (None: none do)
    attainment: dict[str, dict[int, float]] = field(default_factory=dict)  # scheduler -> devices -> attainment
    requests: int = 0

    @property
    def best(self) -> tuple[str, int] | None:
        ok = [(n, i, s) for i, (s, n) in enumerate(self.needed.items()) if n is not None]
        return (min(ok)[2], min(ok)[0]) if ok else None  # ties go to the first scheduler named (ours)

    def shortfall(self) -> str:
        """Why no number of devices reaches the target (when `best` is None): the SLO itself, when requests run
        longer than it even alone; else the schedulers asked for, on every number of devices tried."""
        if self.ceiling < self.target:
            return (f"no number of devices reaches {self.target:.1%}: only {self.ceiling:.2%} of requests run within "
                    "their SLO even alone (relax the SLO or the target)")
        tried = [(share, -n) for att in self.attainment.values() for n, share in att.items()]
        top, fewest = max(tried, default=(0.0, 0))
        return (f"no number of devices up to {max((-n for _, n in tried), default=0)} reaches {self.target:.1%} "
                f"with {', '.join(self.needed)}: the best is {top:.2%} on {-fewest}, although {self.ceiling:.2%} "
                "of requests run within their SLO even alone (try another scheduler)")


def _attainment(prep: Prepared, work: Workload, slo: np.ndarray, alpha: float, n: int, name: str) -> float:
    r = simulate_policies(prep, work, slo, alpha, n, which=(name,), eps=RIGHTSIZE_EPS)[name]
    return r.on_time / r.n if r.n else 1.0


def rightsize(prep: Prepared, slo: np.ndarray, *, alpha: float = 0.1, target: float = 0.99, max_gpus: int = 64,
              schedulers: tuple[str, ...] = SCHEDULERS) -> RightSize:
    """Fewest devices per scheduler (doubling, then bisection: attainment grows with devices)."""
    if not 0 < target <= 1:
        raise InvalidInput(f"target {target}: a share in (0, 1]")
    arrival = prep.arrival - prep.arrival[0]
    work = Workload(arrival, prep.app, prep.group, prep.time, arrival + slo[prep.app])
    out = RightSize(target, float(np.mean(prep.time <= slo[prep.app])), requests=len(arrival))
    if out.ceiling < target:  # no number of devices helps requests that run longer than their SLO alone
        out.needed = {name: None for name in schedulers}
        return out
    for name in schedulers:
        seen: dict[int, float] = {}

        def att(n: int, name: str = name, seen: dict[int, float] = seen) -> float:
            if n not in seen:
                seen[n] = _attainment(prep, work, slo, alpha, n, name)
            return seen[n]

        hi = 1
        while att(hi) < target and hi < max_gpus:
            hi = min(hi * 2, max_gpus)
        if att(hi) < target:
            out.needed[name] = None
        else:
            lo = hi // 2
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if att(mid) >= target:
                    hi = mid
                else:
                    lo = mid
            out.needed[name] = hi
        out.attainment[name] = dict(sorted(seen.items()))
    return out


def _shed_only(workflow_id: str, apps: list[AppWindow], served_last: dict[str, float | None], now: float,
               window_s: float) -> str:
    """Why applications whose every request in the window was shed cannot be left out, nor replayed, and what to
    do: their requests are load, but no execution time of theirs was measured in the window."""
    shed = ", ".join(f"{w.app!r} ({w.dropped})" for w in apps)
    msg = (f"serving workflow {workflow_id!r}: every request of {shed} in the last {window_s:g} s was shed, so "
           "their load cannot be replayed without execution times, and leaving it out would size for less than "
           "arrived")
    never = [a for a, t in served_last.items() if t is None]
    if never:
        return f"{msg}; no request of {never} was ever served, so their execution times are unknown"
    reach = now - min(t for t in served_last.values() if t is not None)  # to the oldest of their last served minutes
    return f"{msg}; give --window {math.ceil(reach)} or more to reach a minute in which each was served"


def prepare_workflow(store: Store, workflow_id: str, *, now: float | None = None, window_s: float = 3600.0,
                     seed: int = 0, alpha: float = 0.1) -> tuple[Prepared, np.ndarray, int]:
    """A store workflow as a simulator input: (prepared requests, SLO per application, devices it holds). `alpha`
    is the batch cost g(b) = 1 + alpha log2 b the per-request times are recovered with: the one the simulation
    uses."""
    now = time.time() if now is None else now
    with store.session() as s:
        apps = [w for w in app_windows(s, now - window_s, now, [workflow_id]) if w.n or w.dropped]
        if not apps:
            get_workflow(s, workflow_id)  # unknown: says so
            last = last_request_minute(s, workflow_id)
        shed_only = [w for w in apps if not w.n]
        if shed_only:  # the window timed none of their requests: when were they last served?
            before = {w.app: w for w in app_windows(s, 0.0, now - window_s, [workflow_id])}
            served_last = {w.app: max((m[0] for m in before[w.app].minutes if m[1]), default=None)
                           if w.app in before else None for w in shed_only}
    if shed_only:
        raise InvalidInput(_shed_only(workflow_id, shed_only, served_last, now, window_s))
    if not apps:
        if last is None:
            raise NotFound(f"workflow {workflow_id!r} has recorded no serving requests (the job SDK's serving mode, "
                           "collector.serving, records them)")
        raise NotFound(f"serving workflow {workflow_id!r}: no requests in the last {window_s:g} s; the newest are "
                       f"in the minute from {now - last:.0f} s ago: give --window {math.ceil(now - last)} or more")
    missing = [w.app for w in apps if w.slo_s is None]
    if missing:
        raise InvalidInput(f"serving workflow {workflow_id!r}: no SLO for {missing}; set one with "
                           "`fleetlens serving slo WORKFLOW APP SECONDS`")
    rng = np.random.default_rng(seed)
    samples, basis = [], {}
    for w in apps:
        if w.batch_sized:
            samples.append(alone_samples(w.exec_by_batch, alpha))
            if w.batch_sized < w.n:
                basis[w.app] = (f"per-request times recovered from the batch sizes of {w.batch_sized} of its {w.n} "
                                "requests (the others' minutes were stored before revision 0016, without them)")
        else:
            samples.append(ls.samples(w.exec_hist))
            basis[w.app] = ("batch times over all batch sizes, taken as per-request times: its minutes were stored "
                            "before revision 0016, without batch sizes, so the devices needed may be overstated")
    grid = TimeGrid.covering(max(float(x.max()) for x in samples) * 1.01)
    names = [w.app for w in apps]
    dists = Distributions(grid, names, samples)
    arr, app, times = [], [], []
    for k, w in enumerate(apps):
        for minute, n, dropped, _met in w.minutes:
            m = n + dropped
            arr.append(minute + rng.random(m) * 60.0)
            app.append(np.full(m, k))
            times.append(samples[k][rng.integers(len(samples[k]), size=m)])
    a, ap, t = np.concatenate(arr), np.concatenate(app), np.concatenate(times)
    order = np.argsort(a, kind="stable")
    prep = Prepared(names, names, dists, Distributions(grid, ["pooled"], [np.concatenate(samples)]), ap[order],
                    ap[order].copy(), a[order], t[order], time_basis=basis)
    slo = np.array([w.slo_s for w in apps])
    return prep, slo, max(w.devices for w in apps)
