"""Right-sizing a serving workflow: the fewest devices on which its measured arrivals and execution-time
distributions meet every application's SLO for at least `target` of requests, per scheduler (ours, the
reconstruction of Orloj's, and the simulator's Clockwork-, Nexus-, Clipper- and Triton-like baselines).

Two sources: a serving workflow in the store (its per-minute histograms: each minute's requests at seeded random
times within it, execution times drawn from its histogram, one batching group per application), and a request
trace (Alibaba's, with real arrivals and times: distributions fit on the first half, the second half replayed at
its real pace). A target no number of devices can meet (requests that run longer than their SLO even alone) is
said so, with the best attainment any number reaches.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from enforcer.serving.distribution import Distributions, TimeGrid
from enforcer.sim.serving.engine import Workload
from enforcer.sim.serving.experiment import Prepared, simulate_policies
from store import latency_sketch as ls
from store.db import Store
from store.errors import InvalidInput, NotFound
from store.serving import app_windows, last_request_minute
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


def prepare_workflow(store: Store, workflow_id: str, *, now: float | None = None, window_s: float = 3600.0,
                     seed: int = 0) -> tuple[Prepared, np.ndarray, int]:
    """A store workflow as a simulator input: (prepared requests, SLO per application, devices it holds)."""
    now = time.time() if now is None else now
    with store.session() as s:
        apps = [w for w in app_windows(s, now - window_s, now, [workflow_id]) if w.n]
        if not apps:
            get_workflow(s, workflow_id)  # unknown: says so
            last = last_request_minute(s, workflow_id)
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
    samples = [ls.samples(w.exec_hist) for w in apps]
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
                    ap[order].copy(), a[order], t[order])
    slo = np.array([w.slo_s for w in apps])
    return prep, slo, max(w.devices for w in apps)
