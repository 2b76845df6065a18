"""A conservative replay of one serving workflow's measured minutes on n devices, for serving.over_provisioned.

Arrivals: each minute's measured requests (served and shed) spread at seeded random times within the minute.
Work: requests of one application are served first-come first-served in batches of up to its measured mean batch
size, a batch taking one execution time drawn from the application's measured execution-time histogram (the
times the SDK measured are batch times). No request is ever dropped and nothing is reordered by deadline, so a
smarter scheduler (enforcer.serving's) can only do better: if this replay meets the SLO on fewer devices, the
service holds more than it needs.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence

import numpy as np

from store import latency_sketch as ls
from store.serving import AppWindow


def attainment_on(apps: Sequence[AppWindow], n_devices: int, *, seed: int = 0) -> dict[str, float]:
    """Share of each application's requests (with an SLO) that meet it when replayed on `n_devices`."""
    rng = np.random.default_rng(seed)
    arr_t: list[np.ndarray] = []
    arr_a: list[np.ndarray] = []
    draws: list[np.ndarray] = []
    sizes: list[int] = []
    for k, w in enumerate(apps):
        for minute, n, dropped, _met in w.minutes:
            m = n + dropped
            if m:
                arr_t.append(minute + rng.random(m) * 60.0)
                arr_a.append(np.full(m, k))
        draws.append(ls.samples(w.exec_hist))
        sizes.append(max(1, round(w.batch_sum / w.n)) if w.n else 1)
    if not arr_t:
        return {}
    t = np.concatenate(arr_t)
    a = np.concatenate(arr_a)
    order = np.argsort(t, kind="stable")
    t, a = t[order], a[order]
    queues: list[deque[float]] = [deque() for _ in apps]
    met = np.zeros(len(apps))
    total = np.bincount(a, minlength=len(apps)).astype(float)
    slo = [w.slo_s if w.slo_s is not None else np.inf for w in apps]
    free_at = [float(t[0])] * n_devices
    heapq.heapify(free_at)
    i = 0
    while i < len(t) or any(queues):
        dev_free = heapq.heappop(free_at)
        while i < len(t) and t[i] <= dev_free:
            queues[a[i]].append(float(t[i]))
            i += 1
        if not any(queues):
            nxt = float(t[i])
            heapq.heappush(free_at, max(dev_free, nxt))
            continue
        k = min((q[0], k) for k, q in enumerate(queues) if q)[1]
        batch = [queues[k].popleft() for _ in range(min(sizes[k], len(queues[k])))]
        d = draws[k]
        run = float(d[rng.integers(len(d))]) if len(d) else 0.0
        end = dev_free + run
        for arrival in batch:
            if end - arrival <= slo[k]:
                met[k] += 1
        heapq.heappush(free_at, end)
    return {w.app: (met[k] / total[k] if total[k] else 1.0) for k, w in enumerate(apps) if w.slo_s is not None}


def fewest_devices(apps: Sequence[AppWindow], held: int, *, seed: int = 0) -> tuple[int, dict[str, float]]:
    """The fewest devices (1..held) on which the replay meets every SLO'd application's target, with the
    attainments there; `held` with its attainments when nothing fewer does."""
    targets = {w.app: w.target for w in apps if w.slo_s is not None}
    for n in range(1, held):
        att = attainment_on(apps, n, seed=seed)
        if att and all(att[app] >= targets[app] for app in att):
            return n, att
    return held, attainment_on(apps, held, seed=seed)
