"""A conservative replay of one serving workflow's measured minutes on n devices, for serving.over_provisioned.

Arrivals: each minute's measured requests (served and shed) spread at seeded random times within the minute.
Work: requests of one application are served first-come first-served in batches of up to its measured mean batch
size, a batch of b requests taking one execution time drawn from the times measured for batches of b's size class
(store.batch_sizes; the times the SDK measures are batch times, longer for larger batches), or, when that class
was not recorded, from the nearest larger class recorded, else (minutes stored before revision 0016) from the
histogram over all sizes. No request is ever dropped and nothing is reordered by deadline, so a
smarter scheduler (enforcer.serving's) can only do better: if this replay meets the SLO on fewer devices, the
service holds more than it needs.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence

import numpy as np

from store import batch_sizes as bs
from store import latency_sketch as ls
from store.serving import AppWindow


def attainment_on(apps: Sequence[AppWindow], n_devices: int, *, seed: int = 0) -> dict[str, float]:
    """Share of each application's requests (with an SLO) that meet it when replayed on `n_devices`."""
    rng = np.random.default_rng(seed)
    arr_t: list[np.ndarray] = []
    arr_a: list[np.ndarray] = []
    draws: list[_BatchTimes] = []  # per application: batch size -> the batch times it draws from
    sizes: list[int] = []
    for k, w in enumerate(apps):
        for minute, n, dropped, _met in w.minutes:
            m = n + dropped
            if m:
                arr_t.append(minute + rng.random(m) * 60.0)
                arr_a.append(np.full(m, k))
        sizes.append(max(1, round(w.batch_sum / w.n)) if w.n else 1)
        draws.append(_BatchTimes(w))
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
        d = draws[k][len(batch)]
        run = float(d[rng.integers(len(d))]) if len(d) else 0.0
        end = dev_free + run
        for arrival in batch:
            if end - arrival <= slo[k]:
                met[k] += 1
        heapq.heappush(free_at, end)
    return {w.app: (met[k] / total[k] if total[k] else 1.0) for k, w in enumerate(apps) if w.slo_s is not None}


class _BatchTimes:
    """The measured batch times a batch of b requests draws from: its size class's, else the nearest larger
    recorded class's (a larger batch runs no shorter), else those over all sizes."""

    def __init__(self, w: AppWindow) -> None:
        self.classes = {c: ls.samples(sc.hist) for c, sc in w.exec_by_batch.items() if sc.n}
        self.every = ls.samples(w.exec_hist)
        self.by_size: dict[int, np.ndarray] = {}

    def __getitem__(self, b: int) -> np.ndarray:
        got = self.by_size.get(b)
        if got is None:
            c = bs.size_class(b)
            at_least = [k for k in self.classes if k >= c]
            got = self.by_size[b] = self.classes[min(at_least)] if at_least else self.every
        return got


def fewest_devices(apps: Sequence[AppWindow], held: int, *, seed: int = 0) -> tuple[int, dict[str, float]]:
    """The fewest devices (1..held) on which the replay meets every SLO'd application's target, with the
    attainments there; `held` with its attainments when nothing fewer does."""
    targets = {w.app: w.target for w in apps if w.slo_s is not None}
    for n in range(1, held):
        att = attainment_on(apps, n, seed=seed)
        if att and all(att[app] >= targets[app] for app in att):
            return n, att
    return held, attainment_on(apps, held, seed=seed)
