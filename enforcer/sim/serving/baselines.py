"""Baseline batch schedulers for the serving simulator (simulator only), each a simplified stand-in named after
the system whose rule it borrows:

- ClockworkLike: a point estimate (the application's mean time), earliest deadline first across batching groups,
  requests dropped once the estimate says they cannot make their deadline, and the largest batch (members in
  deadline order, skipping one that would break the batch) whose estimated time meets every member's deadline;
  optionally (`stop_running`, then named `clockwork_like_stopping`), a batch still running when all its members
  are past their deadlines is stopped (dropped, counted). benchmarks/serving.py adds it to the baselines when it
  scores ours with stopping: most of what stopping gains ours, a point estimate gains by stopping here.
- Oracle: the Clockwork rule with each request's exact time instead of the mean.
- NexusLike: a batch size profiled per group (the largest b with 2 * g(b) * mean <= SLO, Nexus's rule that a
  request may wait one batch and run in the next), FIFO; never drops.
- ClipperLike: an adaptive batch size per group (AIMD: +1 after a batch that ran within its SLO, halved after one
  that did not), FIFO; never drops.
- TritonLike: a group's batch goes when it holds max_batch requests or its oldest has waited max_delay; never
  drops.

FIFO across groups means the group whose oldest request arrived first goes next.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from enforcer.serving.distribution import batch_cost
from enforcer.serving.policy import DEFAULT_MAX_BATCH, RequestView, Selection, queued


class _PointEstimateEDF:
    """EDF with drops and the largest batch that meets every member's deadline under per-request estimates."""

    drops = True

    def __init__(self, alpha: float, max_batch: int = DEFAULT_MAX_BATCH, stop_running: bool = False) -> None:
        self.max_batch = max_batch
        self.stop_running = stop_running
        self.g = [batch_cost(b, alpha) if b else 0.0 for b in range(max_batch + 1)]

    def estimates(self, ids: np.ndarray, view: RequestView) -> np.ndarray:
        raise NotImplementedError

    def select(self, now: float, queues: Mapping[int, list[int]], view: RequestView) -> Selection:
        sel = Selection()
        ids = queued(queues)
        est = self.estimates(ids, view)
        dl = view.deadlines(ids)
        alive = now + est <= dl
        if not alive.all():
            sel.drop.extend(int(i) for i in ids[~alive])
            ids, est, dl = ids[alive], est[alive], dl[alive]
        if ids.size == 0:
            return sel
        groups = view.groups(ids)
        mine = groups == groups[int(np.argmin(dl))]
        ids, est, dl = ids[mine], est[mine], dl[mine]
        chosen: list[int] = []
        longest, earliest = 0.0, np.inf
        for j in np.argsort(dl, kind="stable"):
            if len(chosen) == self.max_batch:
                break
            lo, ed = max(longest, est[j]), min(earliest, dl[j])
            if now + self.g[len(chosen) + 1] * lo <= ed:
                chosen.append(int(j))
                longest, earliest = lo, ed
        sel.batch = [int(ids[j]) for j in chosen]
        if self.stop_running and chosen:
            # a point estimate says nothing once the batch overruns it: stop when every member is late
            sel.stop_after = float(dl[chosen].max()) - now
        return sel

    def completed(self, group: int, batch: Sequence[int], exec_time: float, view: RequestView) -> None:
        return None


class ClockworkLike(_PointEstimateEDF):
    name = "clockwork_like"

    def __init__(self, mean_by_app: np.ndarray, alpha: float, max_batch: int = DEFAULT_MAX_BATCH,
                 stop_running: bool = False) -> None:
        super().__init__(alpha, max_batch, stop_running)
        self.mean_by_app = mean_by_app
        if stop_running:
            self.name = "clockwork_like_stopping"

    def estimates(self, ids: np.ndarray, view: RequestView) -> np.ndarray:
        return self.mean_by_app[view.apps(ids)]


class Oracle(_PointEstimateEDF):
    name = "oracle"

    def __init__(self, true_time: np.ndarray, alpha: float, max_batch: int = DEFAULT_MAX_BATCH) -> None:
        super().__init__(alpha, max_batch)
        self.true_time = true_time

    def estimates(self, ids: np.ndarray, view: RequestView) -> np.ndarray:
        return self.true_time[ids]


class _FifoBatcher:
    """Never drops; serves the group whose oldest request came first, `size(group)` requests at a time."""

    drops = False

    def size(self, group: int) -> int:
        raise NotImplementedError

    def ready(self, now: float, group: int, q: list[int], view: RequestView) -> bool:
        return True

    def select(self, now: float, queues: Mapping[int, list[int]], view: RequestView) -> Selection:
        sel = Selection()
        groups = [g for g, q in queues.items() if q]
        heads = view.arrivals([queues[g][0] for g in groups]) if groups else []
        best = None
        for group, head in zip(groups, heads, strict=True):
            if (best is None or head < best[0]) and self.ready(now, group, queues[group], view):
                best = (float(head), group, queues[group])
        if best is None:
            sel.wake_at = self.wake(queues, view)
            return sel
        _, group, q = best
        sel.batch = list(q[: self.size(group)])
        return sel

    def wake(self, queues: Mapping[int, list[int]], view: RequestView) -> float | None:
        return None

    def completed(self, group: int, batch: Sequence[int], exec_time: float, view: RequestView) -> None:
        return None


class NexusLike(_FifoBatcher):
    name = "nexus_like"

    def __init__(self, group_mean: Mapping[int, float], group_slo: Mapping[int, float], alpha: float,
                 max_batch: int = DEFAULT_MAX_BATCH) -> None:
        self.sizes = {}
        for g, mean in group_mean.items():
            b = 1
            while b < max_batch and 2 * batch_cost(b + 1, alpha) * mean <= group_slo[g]:
                b += 1
            self.sizes[g] = b

    def size(self, group: int) -> int:
        return self.sizes[group]


class ClipperLike(_FifoBatcher):
    name = "clipper_like"

    def __init__(self, group_slo: Mapping[int, float], max_batch: int = DEFAULT_MAX_BATCH) -> None:
        self.group_slo = group_slo
        self.max_batch = max_batch
        self.sizes = {g: 1 for g in group_slo}

    def size(self, group: int) -> int:
        return self.sizes[group]

    def completed(self, group: int, batch: Sequence[int], exec_time: float, view: RequestView) -> None:
        b = self.sizes[group]
        self.sizes[group] = min(self.max_batch, b + 1) if exec_time <= self.group_slo[group] else max(1, b // 2)


class TritonLike(_FifoBatcher):
    name = "triton_like"

    def __init__(self, group_delay: Mapping[int, float], max_batch: int = DEFAULT_MAX_BATCH) -> None:
        self.group_delay = group_delay
        self.max_batch = max_batch

    def size(self, group: int) -> int:
        return self.max_batch

    def ready(self, now: float, group: int, q: list[int], view: RequestView) -> bool:
        return len(q) >= self.max_batch or float(view.arrivals(q[:1])[0]) + self.group_delay[group] <= now + 1e-9

    def wake(self, queues: Mapping[int, list[int]], view: RequestView) -> float | None:
        times = [float(view.arrivals(q[:1])[0]) + self.group_delay[g] for g, q in queues.items() if q]
        return min(times) if times else None
