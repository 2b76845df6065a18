"""Our reconstruction of Orloj's distribution-aware batch scheduler, as a pure policy.

Orloj (MLSys'23) plans batches with each application's empirical execution-time distribution instead of a point
estimate. Its algorithm section was not reachable; this is a reconstruction from the paper's abstract and the
rules below, not its code:

- a batch B of requests runs for g(|B|) * max_i t_i, so its time CDF is prod_i F_i(t / g(|B|));
- a request still in the queue is dropped once its chance of meeting its deadline alone, starting now, falls
  below `eps` (it would only take GPU time from requests that can still make it; the drop is counted);
- a candidate batch scores its expected on-time requests per second of expected batch time; candidates are built
  greedily from one batching group (a base model: a batch never mixes models), members taken in deadline order
  and kept only when they raise the score;
- the group served next is the one whose most urgent live request has the earliest deadline (EDF across groups),
  or, with `pick="rate"`, the group whose best batch scores highest.

The policy sees only queues of request ids and a `RequestView` (application, deadline): never a request's true
time. The simulator (enforcer/sim/serving) and the live queue (enforcer/serving/live.py) both call `select`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from enforcer.serving.distribution import Distributions, batch_cost
from store.errors import InvalidInput

DEFAULT_MAX_BATCH = 8
DEFAULT_EPS = 0.05


class RequestView(Protocol):
    """What a policy may read of queued requests, by id."""

    def apps(self, ids: Sequence[int]) -> np.ndarray: ...
    def deadlines(self, ids: Sequence[int]) -> np.ndarray: ...
    def arrivals(self, ids: Sequence[int]) -> np.ndarray: ...


@dataclass
class Selection:
    """A policy's answer: the batch to run now (ids, possibly empty), the ids to drop, and when to ask again if
    nothing runs although requests wait (a batching delay), else None."""

    batch: list[int] = field(default_factory=list)
    drop: list[int] = field(default_factory=list)
    wake_at: float | None = None
    predicted_cdf: np.ndarray | None = None  # the batch's time CDF on the grid in units of t / g(|B|)


class BatchPolicy(Protocol):
    name: str
    drops: bool

    def select(self, now: float, queues: Mapping[int, list[int]], view: RequestView) -> Selection: ...

    def completed(self, group: int, batch: Sequence[int], exec_time: float, view: RequestView) -> None: ...


def batch_score(cdfs: np.ndarray, slack: np.ndarray, g: float, dists: Distributions) -> tuple[float, np.ndarray, float]:
    """(expected on-time requests / expected batch seconds, the batch's max-time CDF, expected seconds) of a batch
    whose members have CDF rows `cdfs` and `slack` seconds each to their deadlines."""
    pmax = np.prod(cdfs, axis=0)
    expected = g * dists.expected_time(pmax)
    on_time = float(pmax[dists.grid.indices(slack / g)].sum())
    return on_time / max(expected, 1e-12), pmax, expected


class DistributionAware:
    """The reconstruction (see the module's docstring). `dists` may be per application, one pooled
    distribution (every app index mapped to row 0 by `app_row`), or point masses (what the fixed-time control
    and an oracle see)."""

    name = "distribution_aware"
    drops = True

    def __init__(self, dists: Distributions, alpha: float, *, eps: float = DEFAULT_EPS,
                 max_batch: int = DEFAULT_MAX_BATCH, pick: str = "edf", app_row: np.ndarray | None = None,
                 lookahead: int = 16) -> None:
        if not 0.0 <= eps < 1.0:
            raise InvalidInput(f"drop threshold eps={eps}: a probability in [0, 1)")
        if max_batch < 1:
            raise InvalidInput(f"max_batch={max_batch}: at least 1")
        if pick not in ("edf", "rate"):
            raise InvalidInput(f"pick={pick!r}: 'edf' or 'rate'")
        self.dists = dists
        self.alpha = alpha
        self.eps = eps
        self.max_batch = max_batch
        self.pick = pick
        self.app_row = app_row
        self.lookahead = lookahead
        self.g = [batch_cost(b, alpha) if b else 0.0 for b in range(max_batch + 1)]

    def _rows(self, apps: np.ndarray) -> np.ndarray:
        return apps if self.app_row is None else self.app_row[apps]

    def _best_batch(self, now: float, ids: np.ndarray, rows: np.ndarray, dl: np.ndarray):
        """Greedy: members in deadline order, each kept only if it raises the score. The running product of
        the members' CDFs makes each trial one pass over the grid."""
        order = np.argsort(dl, kind="stable")[: self.lookahead]
        cdf = self.dists.cdf
        step = self.dists.grid.step
        chosen: list[int] = []
        best = (-1.0, None, 0.0)
        pmax = None
        for j in order:
            if len(chosen) == self.max_batch:
                break
            trial_p = cdf[rows[j]] if pmax is None else pmax * cdf[rows[j]]
            trial = chosen + [int(j)]
            g = self.g[len(trial)]
            expected = g * step * float(np.sum(1.0 - trial_p[:-1]))
            on_time = float(trial_p[self.dists.grid.indices((dl[trial] - now) / g)].sum())
            score = on_time / max(expected, 1e-12)
            if score > best[0]:
                chosen, best, pmax = trial, (score, trial_p, expected), trial_p
        return chosen, best

    def select(self, now: float, queues: Mapping[int, list[int]], view: RequestView) -> Selection:
        sel = Selection()
        best_key = None
        for group, q in queues.items():
            if not q:
                continue
            ids = np.asarray(q)
            rows = self._rows(view.apps(ids))
            dl = view.deadlines(ids)
            alive = self.dists.cdf[rows, self.dists.grid.indices(dl - now)] >= self.eps
            if not alive.all():
                sel.drop.extend(int(i) for i in ids[~alive])
                ids, rows, dl = ids[alive], rows[alive], dl[alive]
                if ids.size == 0:
                    continue
            if self.pick == "edf":
                key = float(dl.min())
                if best_key is not None and key >= best_key[0]:
                    continue
                best_key = (key, group, ids, rows, dl)
            else:
                chosen, score = self._best_batch(now, ids, rows, dl)
                if best_key is None or score[0] > best_key[0]:
                    best_key = (score[0], group, ids[chosen], score)
        if best_key is None:
            return sel
        if self.pick == "edf":
            _, _, ids, rows, dl = best_key
            chosen, score = self._best_batch(now, ids, rows, dl)
            sel.batch = [int(i) for i in ids[chosen]]
        else:
            _, _, batch, score = best_key
            sel.batch = [int(i) for i in batch]
        sel.predicted_cdf = score[1]
        return sel

    def completed(self, group: int, batch: Sequence[int], exec_time: float, view: RequestView) -> None:
        return None
