"""What the consolidation figures are measured against, computed from the same trace as the replay
(enforcer.sim.replay): hindsight bounds (per-minute lower bound, one static packing, the whole-device bound for
fractional pods) and re-packing from scratch every cycle with no hindsight and free moves (by the planner's own
per-job sizing, or by the combined memory of each device's jobs)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from enforcer.consolidate import Packing, lane_bytes
from enforcer.consolidation_sizing import ConsolidateParams, JobDemand, Size, size_jobs
from enforcer.sim.readers.demand import DemandTrace
from store.errors import InvalidInput
from store.headroom import LANE_FACTOR, PERSISTENT_FACTOR


def lower_bound(trace: DemandTrace, capacity: int, step_s: float = 60.0) -> tuple[float, int]:
    """Per telemetry step, max(ceil(sum mem / capacity), ceil(sum util)): its mean and peak (hindsight bound)."""
    stamps = np.unique(np.concatenate([j.times for j in trace.jobs if len(j.times)]))
    if not len(stamps):
        return 0.0, 0
    mem = np.zeros(len(stamps))
    util = np.zeros(len(stamps))
    for j in trace.jobs:
        if not len(j.times):
            continue
        k = np.searchsorted(stamps, j.times)
        np.add.at(mem, k, j.mem)
        np.add.at(util, k, j.util)
    bound = np.maximum(np.ceil(mem / capacity), np.ceil(util - 1e-9))
    return float(bound.mean()), int(bound.max())


def repack_every_cycle(trace: DemandTrace, devices: list[tuple[int, int]], params: ConsolidateParams | None = None,
                       interval_s: float = 900.0, *, headroom: bool = True) -> float:
    """Mean devices held if every cycle re-packed every job from scratch with the planner's own sizing (telemetry
    up to that cycle only, Salus's lanes, the compute cap) and moves cost nothing: what this sizing allows
    without any move cap. Jobs that may not share hold a device each; the others go largest lane first to the
    best-fitting device in use (Packing.place_new). Each cycle's count holds until the next. `headroom=False`:
    each lane is exactly the job's recent peak (Salus's 1.1 x 1.05 taken off), the least a job's share can be."""
    p = params or ConsolidateParams()
    jobs = [j for j in trace.jobs if j.departure is not None]
    if not jobs:
        raise InvalidInput(f"the {trace.kind} trace has no job with a departure to re-pack")
    t0, t_end = min(j.arrival for j in jobs), max(j.departure for j in jobs)
    cap = max(c for _, c in devices)
    held_s = 0.0
    for t in np.arange(t0, t_end, interval_s):
        alive = [j for j in jobs if j.arrival <= t < j.departure]
        demands = []
        for j in alive:
            n = int(np.searchsorted(j.times, t, side="right"))
            demands.append(JobDemand(j.id, None, j.times[:n], j.mem[:n], j.util[:n], j.declared_mem,
                                     j.declared_util))
        sizes = size_jobs(demands, float(t), p)
        pk = Packing(devices, p.util_cap)
        whole = sum(j.gpus for j in alive if j.gpus > 1)
        for size in sorted(sizes.values(), key=lambda s: (s.shareable, -lane_bytes(s, cap), s.job_id)):
            if size.why == "no_samples":
                size = Size(size.job_id, 0, 1.0, False, size.why)
            elif not headroom and size.shareable:
                size = Size(size.job_id, int(size.mem / (PERSISTENT_FACTOR * LANE_FACTOR)), size.util, True, size.why)
            pk.place_new(size)
        held_s += (whole + int((pk.n_jobs > 0).sum())) * (min(t + interval_s, t_end) - t)
    return held_s / (t_end - t0)


def static_ffd(trace: DemandTrace, capacity: int, quantile: float = 0.95) -> int:
    """Devices for one first-fit-decreasing packing on each job's whole-life peak memory and p95 utilisation."""
    items = sorted(((float(j.mem.max()), float(np.quantile(j.util, quantile))) for j in trace.jobs if len(j.mem)),
                   reverse=True)
    bins: list[list[float]] = []
    for m, u in items:
        for b in bins:
            if b[0] + m <= capacity and b[1] + u <= 1.0 + 1e-9:
                b[0] += m
                b[1] += u
                break
        else:
            bins.append([m, u])
    return len(bins)


def fractional_device_hours(trace: DemandTrace) -> tuple[float, float]:
    """(exclusive, fractional) device-hours: whole devices per pod, and the sum of shares over time."""
    excl = frac = 0.0
    for j in trace.jobs:
        if j.departure is None:
            continue
        d = (j.departure - j.arrival) / 3600.0
        excl += j.gpus * d
        frac += (j.gpus if j.gpus > 1 else (j.declared_util or 1.0)) * d
    return excl, frac


def integral_device_hours(trace: DemandTrace) -> float:
    """Device-hours if, at every instant, whole-device pods hold their devices and fractional pods fill
    ceil(sum of shares) devices: no packing does better, since devices are whole."""
    events = []
    for j in trace.jobs:
        if j.departure is None:
            continue
        share = j.declared_util or 1.0
        whole = j.gpus if (j.gpus > 1 or share >= 1.0) else 0
        frac = 0.0 if whole else share
        events += [(j.arrival, whole, frac), (j.departure, -whole, -frac)]
    if not events:
        raise InvalidInput(f"the {trace.kind} trace has no job with a departure")
    events.sort()
    t = np.array([e[0] for e in events])
    whole = np.cumsum([e[1] for e in events])
    frac = np.cumsum([e[2] for e in events])
    return float(((whole[:-1] + np.ceil(frac[:-1] - 1e-9)) * np.diff(t)).sum() / 3600.0)


@dataclass(frozen=True, slots=True)
class CombinedRepack:
    slack_bytes: int
    mean_devices: float  # over the trace's telemetry steps, devices holding a job
    overcommit_device_minutes: float  # steps in which a device's jobs' real memory was over its capacity


def repack_by_combined_memory(trace: DemandTrace, capacity: int, slack_bytes: int,
                              params: ConsolidateParams | None = None,
                              interval_s: float = 900.0) -> CombinedRepack:
    """Every cycle re-packs every job from scratch, sizing a device by the combined memory its jobs showed over the
    recent window (the peak of their summed readings, not the sum of their peaks, as per-job shares must be) plus
    `slack_bytes` for a rise before the next reading: how far below per-job shares a planner could go that lets
    co-located jobs borrow each other's unused memory, and what that costs in overcommit. No hindsight (each cycle
    sees readings up to then only), no compute cap, moves free. A job watched for less than `min_history_s` holds
    a device alone, as does one that arrives between cycles until the next. Jobs go largest recent peak first to
    the device with the least room left (best fit)."""
    p = params or ConsolidateParams()
    jobs = [j for j in trace.jobs if len(j.times)]
    if not jobs:
        raise InvalidInput(f"the {trace.kind} trace has no memory readings to re-pack")
    stamps = np.unique(np.concatenate([j.times for j in jobs]))
    mem = np.zeros((len(jobs), len(stamps)))
    alive = np.zeros((len(jobs), len(stamps)), dtype=bool)
    first = np.empty(len(jobs), dtype=np.int64)
    last = np.empty(len(jobs), dtype=np.int64)
    for k, j in enumerate(jobs):
        at = np.searchsorted(stamps, j.times)
        mem[k, at] = j.mem
        first[k], last[k] = at[0], at[-1]
        alive[k, first[k]:last[k] + 1] = True
    step_min = (trace.step_s or 60.0) / 60.0
    cycles = np.searchsorted(stamps, np.arange(stamps[0], stamps[-1] + 1e-9, interval_s))
    cycles = np.unique(np.append(cycles, len(stamps)))
    held = np.zeros(len(stamps))
    over = 0.0
    for c, nxt in zip(cycles[:-1], cycles[1:], strict=True):
        lo = int(np.searchsorted(stamps, stamps[c] - p.window_s))
        live = np.flatnonzero((first <= c) & (last >= c))
        trusted = [k for k in live if stamps[c] - stamps[first[k]] >= p.min_history_s]
        alone = [k for k in live if stamps[c] - stamps[first[k]] < p.min_history_s]
        devices: list[tuple[np.ndarray, list[int]]] = []  # (summed readings over the window, its jobs)
        for k in sorted(trusted, key=lambda k: -mem[k, lo:c + 1].max()):
            series = mem[k, lo:c + 1]
            best, room = None, 0.0
            for summed, members in devices:
                left = capacity - (summed + series).max() - slack_bytes
                if left >= 0 and (best is None or left < room):
                    best, room = (summed, members), left
            if best is None:
                devices.append((series.copy(), [k]))
            else:
                summed, members = best
                summed += series  # in place: the device's entry sees it
                members.append(k)
        devices += [(np.zeros(0), [k]) for k in alone]
        placed = np.zeros(len(jobs), dtype=bool)
        for _, members in devices:
            placed[members] = True
            held[c:nxt] += alive[members, c:nxt].any(axis=0)
            over += float((mem[members, c:nxt].sum(axis=0) > capacity).sum()) * step_min
        held[c:nxt] += alive[~placed, c:nxt].sum(axis=0)  # arrived since the cycle: a device each
    return CombinedRepack(slack_bytes, float(held.mean()), over)
