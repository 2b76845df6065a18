"""Consolidation's sizing: what a job is planned at, from the demand telemetry has shown of it so far.

Pure and in memory (each job's observed history in; its size out), the inputs of enforcer.consolidate, which packs
by these sizes. Nothing here sees the future: a job is sized from its samples up to `now` only. The consolidation's
parameters (`ConsolidateParams`: the sizing window and the packing's caps alike) are defined here, with the sizing
that reads them first.

Sizing. Memory is the job's peak over the recent window; Salus's admission (enforcer.lanes) adds its headroom
(P' = 1.1 P, lane = 1.05 P'). Compute is the p95 of its utilisation over the same window. A job is shareable (may
be co-located) when its memory is declared (a quota known at arrival) or when its history covers `min_history_s`
and its memory is not still growing (the median of the last quarter of the window above the earlier peak: a new
level, not a passing spike); otherwise it keeps a device to itself.

Two "wait before sharing" rules, on purpose. Admission (`fleetlens run`, the planner:
store.device_memory.known_memory, FLEETLENS_MEMORY_SEEN_STEPS) lets a job of undeclared memory share once its
memory was seen for N steps or samples: it trusts a training job's per-iteration profile (P, E), which repeats
every step, so a count of steps covers it however long a step is, and the share it earns is enforced as the job's
own memory cap. `min_history_s` (FLEETLENS_CONSOLIDATE_MIN_HISTORY_S) trusts something else: a peak over hours of
memory that follows load (serving containers, traces with no steps at all, as in the simulator), which only
wall-clock history and the growth test can vouch for; its safety net is the guard move, sized from the same
window. Either rule in the other's place is wrong: 45 minutes before a training job may join a lane delays
packing with nothing gained, and 20 one-second samples of a service say nothing of its evening peak.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from enforcer.lanes import Job
from store.errors import InvalidInput
from store.settings import Settings


@dataclass(frozen=True, slots=True)
class ConsolidateParams:
    window_s: float = 3 * 3600.0  # memory peak and utilisation p95 are taken over this recent window
    min_history_s: float = 2700.0  # a job is co-located only after this much history (time, not steps: see above)
    growth: float = 0.02  # a new high this much above the earlier peak of the window, lately: still growing
    util_cap: float = 1.0  # most compute (sum of p95 utilisation) planned on one shared device
    util_guard: float = 1.2  # compute over this on a shared device moves a job off (too much slows, never fails)
    max_moves_per_cycle: int = 40
    max_moves_per_job_day: int = 1  # a job moved (for any reason) this many times in a day is not moved to free a
    # device; guard moves (memory running out) are never held back
    downtime_s: float = 30.0  # a move's downtime (benchmarks/migration.py measures it)
    horizon_s: float = 3600.0  # how long a freed device is counted as given back when weighing a move

    @classmethod
    def from_settings(cls, settings: Settings) -> ConsolidateParams:
        return cls(
            window_s=settings.consolidate_window_s, min_history_s=settings.consolidate_min_history_s,
            util_cap=settings.consolidate_util_cap, util_guard=settings.consolidate_util_guard,
            max_moves_per_cycle=settings.consolidate_max_moves_per_cycle,
            max_moves_per_job_day=settings.consolidate_max_moves_per_job_day,
            downtime_s=settings.consolidate_downtime_s, horizon_s=settings.consolidate_horizon_s,
        )


@dataclass(slots=True)
class JobDemand:
    """One job as telemetry has shown it up to now.

    times / mem / util: its samples so far (epoch seconds, bytes, 0..1), oldest first. declared_mem / declared_util:
    what it asked for at arrival when it did (a quota), which stands in for history. device_id: where it runs now
    (None: not placed). since_checkpoint_s: work a move would lose. moves: times of its earlier moves.
    """

    job_id: str
    device_id: int | None = None
    times: np.ndarray = field(default_factory=lambda: np.zeros(0))
    mem: np.ndarray = field(default_factory=lambda: np.zeros(0))
    util: np.ndarray = field(default_factory=lambda: np.zeros(0))
    declared_mem: int | None = None
    declared_util: float | None = None
    movable: bool = True
    gpus: int = 1
    whole: bool = False  # holds its device whole (a part of a multi-device job)
    since_checkpoint_s: float = 0.0
    moves: list[float] = field(default_factory=list)
    # hosts besides its own that can read its checkpoint location (it may move only there or within its host);
    # None: no storage facts (a simulation), any host will do
    readable_hosts: frozenset[str] | None = None


@dataclass(frozen=True, slots=True)
class Size:
    job_id: str
    mem: int  # bytes the job is sized at (before Salus's headroom)
    util: float
    shareable: bool
    why: str  # declared | steady | short_history | growing | no_samples

    def lane_job(self) -> Job:
        # context 0: `mem` is what NVML showed of the job's processes, their CUDA contexts and workspaces included
        return Job(self.job_id, persistent=self.mem, ephemeral=0, util=self.util, exclusive=not self.shareable,
                   context=0)



def size_job(d: JobDemand, now: float, p: ConsolidateParams) -> Size:
    """What the job is planned at: recent peak memory, recent p95 utilisation, and whether it may share."""
    return size_jobs([d], now, p)[d.job_id]


def size_jobs(demands: list[JobDemand], now: float, p: ConsolidateParams) -> dict[str, Size]:
    """size_job for many jobs at once: their histories are laid end to end in one array and every peak and
    quantile is taken per segment in a few numpy calls, so a cycle of 20,000 jobs costs no Python loop of array
    calls per job.

    Memory: the peak over the window (the last readings when none is in the window). Compute: the p95 of the
    utilisation over the same samples, an unknown reading counting as a busy device. A job watched for less than
    `min_history_s` may not share; nor may one still growing: the median of its memory over the last quarter of
    the window above the earlier part's peak (a new level, not a passing spike)."""
    sizes: dict[str, Size] = {}
    seen: list[JobDemand] = []
    for d in demands:
        if d.whole:
            sizes[d.job_id] = Size(d.job_id, int(d.declared_mem or 0), 1.0, False, "whole_device")
        elif d.declared_mem is not None:
            util = d.declared_util if d.declared_util is not None else 1.0
            sizes[d.job_id] = Size(d.job_id, int(d.declared_mem), float(util), True, "declared")
        elif len(d.mem) == 0:
            sizes[d.job_id] = Size(d.job_id, 0, 1.0, False, "no_samples")
        elif not len(d.times) == len(d.mem) == len(d.util):
            raise InvalidInput(f"job {d.job_id!r}: {len(d.times)} sample times, {len(d.mem)} memory and "
                               f"{len(d.util)} utilisation readings; each sample needs all three")
        else:
            seen.append(d)
    if not seen:
        return sizes
    count = len(seen)
    lengths = np.fromiter((len(d.mem) for d in seen), dtype=np.int64, count=count)
    base = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    end = base + lengths
    lo = np.fromiter((d.times.searchsorted(now - p.window_s) for d in seen), dtype=np.int64, count=count)
    lo = np.where(lo >= lengths, 0, lo)  # nothing in the window: the last readings are all there is
    mid = np.fromiter((d.times.searchsorted(now - p.window_s / 4) for d in seen), dtype=np.int64, count=count)
    watched = np.fromiter((d.times[-1] - d.times[0] for d in seen), dtype=float, count=count)
    mem = np.concatenate([d.mem for d in seen] + [np.zeros(1)])  # one spare element: reduceat's last bound
    util = np.concatenate([d.util for d in seen])
    util = np.where(np.isnan(util), 1.0, util)
    start = base + lo
    peak = _segment_max(mem, start, end)
    p95 = _segment_quantile(util, start, end, 0.95)
    has_both = (lo < mid) & (mid < lengths)
    split = base + mid
    earlier = _segment_max(mem, np.where(has_both, start, 0), np.where(has_both, split, 1))
    recent = _segment_quantile(mem, np.where(has_both, split, 0), np.where(has_both, end, 1), 0.5)
    growing = has_both & (recent > earlier * (1.0 + p.growth))
    short = watched < p.min_history_s
    for k, d in enumerate(seen):
        why = "short_history" if short[k] else "growing" if growing[k] else "steady"
        sizes[d.job_id] = Size(d.job_id, int(peak[k]), float(p95[k]), why == "steady", why)
    return sizes


def _segment_max(values: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """max(values[start[k]:end[k]]) for every k (each segment non-empty; `values` has a spare element at the end
    so that the last bound is an index)."""
    bounds = np.empty(2 * len(start), dtype=np.int64)
    bounds[0::2], bounds[1::2] = start, end
    return np.maximum.reduceat(values, bounds)[0::2]


def _segment_quantile(values: np.ndarray, start: np.ndarray, end: np.ndarray, q: float) -> np.ndarray:
    """np.quantile(values[start[k]:end[k]], q) (linear interpolation) for every k, each non-empty: segments of one
    length are gathered into a matrix and partially sorted row by row."""
    out = np.empty(len(start))
    length = end - start
    for n in np.unique(length):
        rows = np.flatnonzero(length == n)
        block = values[start[rows, None] + np.arange(n)]
        pos = q * (n - 1)
        i = int(pos)
        j = min(i + 1, int(n) - 1)
        part = np.partition(block, (i, j), axis=1)
        out[rows] = part[:, i] + (part[:, j] - part[:, i]) * (pos - i)
    return out
