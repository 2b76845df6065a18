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
  or, with `pick="rate"`, the group whose best batch scores highest (a shortest-job-like order: it finishes more
  on time, but also when every time is known exactly, so its gain is the order's, not the distributions');
- optionally (`stop_running`), a running batch is stopped once, given how long it has run, no member's chance of
  finishing by its deadline reaches `stop_eps` (at most `eps`, and `eps` unless given: for a request running alone
  the two thresholds then agree; an iterative model stops between steps; the live queue hands the serving loop the
  moment as `LiveBatch.stop_at`). Off by default: benchmarks/serving.py reports it beside the headline, as a point
  estimate stopped at its last member's deadline gains most of what it gives ours.

The policy sees only queues of request ids and a `RequestView` (application, deadline): never a request's true
time. The simulator (enforcer/sim/serving) and the live queue (enforcer/serving/live.py) both call `select`.
"""

from __future__ import annotations

import itertools
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
    def groups(self, ids: Sequence[int]) -> np.ndarray: ...


class ArrayRequestView:
    """A RequestView over per-request arrays indexed by id (`app`, `group`, `arrival`, `deadline`): the simulator's
    workload and the live queue both keep their requests so."""

    app: np.ndarray
    group: np.ndarray
    arrival: np.ndarray
    deadline: np.ndarray

    def apps(self, ids: Sequence[int]) -> np.ndarray:
        return self.app[ids]

    def deadlines(self, ids: Sequence[int]) -> np.ndarray:
        return self.deadline[ids]

    def arrivals(self, ids: Sequence[int]) -> np.ndarray:
        return self.arrival[ids]

    def groups(self, ids: Sequence[int]) -> np.ndarray:
        return self.group[ids]


def queued(queues: Mapping[int, list[int]]) -> np.ndarray:
    """Every queued id, all groups together (one numpy pass instead of one per group)."""
    return np.fromiter(itertools.chain.from_iterable(queues.values()), dtype=np.int64)


@dataclass
class Selection:
    """A policy's answer: the batch to run now (ids, possibly empty), the ids to drop, and when to ask again if
    nothing runs although requests wait (a batching delay), else None."""

    batch: list[int] = field(default_factory=list)
    drop: list[int] = field(default_factory=list)
    wake_at: float | None = None
    predicted_cdf: np.ndarray | None = None  # the batch's time CDF on the grid in units of t / g(|B|)
    stop_after: float | None = None  # seconds after its start at which the batch is stopped unfinished


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
                 lookahead: int = 16, stop_running: bool = False, stop_eps: float | None = None) -> None:
        if not 0.0 <= eps < 1.0:  # NaN fails too
            raise InvalidInput(f"drop threshold eps={eps}: a probability in [0, 1)")
        if isinstance(max_batch, bool) or not isinstance(max_batch, int | np.integer) or max_batch < 1:
            raise InvalidInput(f"max_batch={max_batch!r}: a whole number of requests, at least 1")
        if isinstance(lookahead, bool) or not isinstance(lookahead, int | np.integer) or lookahead < 1:
            # with none looked at, no batch is ever formed while requests wait
            raise InvalidInput(f"lookahead={lookahead!r}: a whole number of requests, at least 1")
        if pick not in ("edf", "rate"):
            raise InvalidInput(f"pick={pick!r}: 'edf' or 'rate'")
        if stop_eps is None:
            stop_eps = eps
        if stop_running and not 0.0 < stop_eps <= eps:
            # a request kept because its chance alone is >= eps, but below stop_eps, would be handed out in a batch
            # already due to stop: the two thresholds would contradict each other
            raise InvalidInput(f"stop_eps={stop_eps} with eps={eps}: stopping needs 0 < stop_eps <= eps, or the "
                               "queue keeps requests that the stop rule gives up as soon as they start")
        self.dists = dists
        self.alpha = alpha
        self.eps = eps
        self.max_batch = max_batch
        self.pick = pick
        self.app_row = app_row
        self.lookahead = lookahead
        self.stop_running = stop_running
        self.stop_eps = stop_eps
        self.g = [batch_cost(b, alpha) if b else 0.0 for b in range(max_batch + 1)]  # refuses a bad alpha

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

    def _alive(self, now: float, ids: np.ndarray, view: RequestView, sel: Selection):
        rows = self._rows(view.apps(ids))
        dl = view.deadlines(ids)
        alive = self.dists.cdf[rows, self.dists.grid.indices(dl - now)] >= self.eps
        if not alive.all():
            sel.drop.extend(int(i) for i in ids[~alive])
            ids, rows, dl = ids[alive], rows[alive], dl[alive]
        return ids, rows, dl

    def _finish(self, now: float, sel: Selection, batch: np.ndarray, score, view: RequestView) -> Selection:
        sel.batch = [int(i) for i in batch]
        sel.predicted_cdf = score[1]
        if self.stop_running:
            sel.stop_after = self.stop_time(now, score[1], view.deadlines(sel.batch), len(sel.batch))
        return sel

    def select(self, now: float, queues: Mapping[int, list[int]], view: RequestView) -> Selection:
        sel = Selection()
        if self.pick == "edf":
            ids, rows, dl = self._alive(now, queued(queues), view, sel)
            if ids.size == 0:
                return sel
            groups = view.groups(ids)
            mine = groups == groups[int(np.argmin(dl))]
            ids, rows, dl = ids[mine], rows[mine], dl[mine]
            chosen, score = self._best_batch(now, ids, rows, dl)
            return self._finish(now, sel, ids[chosen], score, view)
        best_key = None
        for group, q in queues.items():
            if not q:
                continue
            ids, rows, dl = self._alive(now, np.asarray(q), view, sel)
            if ids.size == 0:
                continue
            chosen, score = self._best_batch(now, ids, rows, dl)
            if best_key is None or score[0] > best_key[0]:
                best_key = (score[0], group, ids[chosen], score)
        if best_key is None:
            return sel
        return self._finish(now, sel, best_key[2], best_key[3], view)

    def stop_time(self, now: float, pmax: np.ndarray, deadlines: np.ndarray, b: int) -> float | None:
        """When a running batch that has not finished should be stopped: the first time at which, given that it
        is still running, every member's chance of finishing by its deadline is below stop_eps (an iterative model --
        diffusion steps, decoded tokens, early-exit layers -- can stop between steps; what is stopped is counted
        as dropped). None: never before the last member's deadline makes no difference."""
        g = self.g[b]
        grid = self.dists.grid
        cells = grid.cells
        f = pmax[:cells]
        tail = np.maximum(1.0 - f, 1e-12)  # P(T > tau) at each cell's upper edge, tau in units of t
        reach = f[np.clip(grid.indices((deadlines - now) / g), 0, cells - 1)]  # P(T <= slack_i)
        cond = (reach[:, None] - f[None, :]) / tail[None, :]
        cond = np.where(f[None, :] >= reach[:, None], 0.0, cond).max(axis=0)
        below = np.flatnonzero(cond < self.stop_eps)
        if below.size == 0:
            return None
        return float((below[0] + 1) * grid.step * g)

    def completed(self, group: int, batch: Sequence[int], exec_time: float, view: RequestView) -> None:
        return None
