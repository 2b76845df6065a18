"""Demand replay: jobs whose memory and utilisation change over time arrive, run and leave on a pool of devices,
and the consolidation cycle (enforcer.consolidate) re-packs them every interval, seeing only the past.

At each time step: jobs that left are taken off; jobs that arrived are placed (enforcer.consolidate.Packing: next
to others when their demand is declared, else a device alone); when a cycle is due, the planner gets every job's
telemetry up to now (never its future readings nor its departure) and its moves are carried out; then the step is
measured: devices holding a job, and overcommit (devices whose jobs' real memory is over capacity).
A job that cannot be placed gets its reason; one whose memory outgrows the device it runs on alone is stopped
with that reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from enforcer.consolidate import Packing, plan_consolidation
from enforcer.consolidation_sizing import ConsolidateParams, JobDemand, Size, size_job
from enforcer.sim.readers.demand import DemandJob, DemandTrace
from store.errors import InvalidInput


@dataclass
class ReplayResult:
    mean_devices: float  # over the replayed time, devices holding at least one job
    peak_devices: int
    device_hours: float
    moves: list[tuple[float, str, int, int, str]]  # (time, job, from device, to device, reason)
    overcommit_device_minutes: float
    reasons: dict[str, str]  # job -> why it was not placed or was stopped
    job_days: float  # sum of the jobs' time alive, in days
    series: list[tuple[float, int, int]] = field(default_factory=list)  # (time, devices held, devices plan needs)
    cycles: int = 0
    overcommits: list[tuple[float, int, list[str]]] = field(default_factory=list)  # (time, device, its jobs)

    @property
    def moves_per_job_day(self) -> float:
        return len(self.moves) / self.job_days if self.job_days > 0 else 0.0

    def as_dict(self) -> dict:
        return {"mean_devices": self.mean_devices, "peak_devices": self.peak_devices,
                "device_hours": self.device_hours, "moves": len(self.moves),
                "moves_per_job_day": self.moves_per_job_day,
                "overcommit_device_minutes": self.overcommit_device_minutes, "cycles": self.cycles,
                "not_placed": dict(self.reasons)}


class _Live:
    """A job while it is replayed: where its telemetry has got to."""

    __slots__ = ("job", "upto", "moves", "parts")

    def __init__(self, job: DemandJob) -> None:
        self.job = job
        self.upto = 0  # samples with time <= now
        self.moves: list[float] = []
        self.parts: list[int] = []  # device positions of a multi-device job

    def advance(self, now: float) -> None:
        self.upto = int(np.searchsorted(self.job.times, now, side="right"))

    def demand(self, device_id: int | None) -> JobDemand:
        j, n = self.job, self.upto
        return JobDemand(j.id, device_id, j.times[:n], j.mem[:n], j.util[:n], j.declared_mem, j.declared_util,
                         movable=j.gpus == 1, gpus=j.gpus, moves=self.moves)

    def real_mem(self) -> float:
        if self.job.declared_mem is not None:
            return float(self.job.declared_mem)
        return float(self.job.mem[self.upto - 1]) if self.upto else 0.0


def replay(trace: DemandTrace, devices: list[tuple[int, int]], params: ConsolidateParams | None = None, *,
           interval_s: float = 900.0, consolidate: bool = True, guard_every_sample: bool = True) -> ReplayResult:
    """Replay `trace` on `devices` ((device id, bytes) each); `consolidate=False` places at arrival only;
    `guard_every_sample=False` checks for memory growth only at the cycles."""
    p = params or ConsolidateParams()
    if not trace.jobs:
        raise InvalidInput(f"the {trace.kind} trace has no job to replay")
    if not devices:
        raise InvalidInput("no devices to replay on; give at least one")
    jobs = sorted(trace.jobs, key=lambda j: (j.arrival, j.id))
    t0 = jobs[0].arrival
    ends = [j.departure for j in jobs if j.departure is not None]
    t_end = max(ends) if ends else max(j.arrival for j in jobs)
    # the steps: telemetry instants, arrivals, departures, cycles
    stamps = [j.arrival for j in jobs] + ends
    for j in jobs:
        if len(j.times):
            stamps.extend(j.times.tolist())
    cycles_at = np.arange(t0 + interval_s, t_end, interval_s) if consolidate else np.zeros(0)
    steps = np.unique(np.concatenate([np.asarray(stamps, dtype=float), cycles_at]))
    steps = steps[steps <= t_end]
    cycle_set = set(cycles_at.tolist())
    has_series = any(len(j.times) for j in jobs)
    sampled = set(np.concatenate([j.times for j in jobs]).tolist()) if has_series else set()

    pk = Packing(devices, p.util_cap)
    dev_ids = [d for d, _ in devices]
    pos_of = {d: i for i, d in enumerate(dev_ids)}
    cap = pk.capacity
    live: dict[str, _Live] = {}
    reasons: dict[str, str] = dict(trace.rejected)
    moves: list[tuple[float, str, int, int, str]] = []
    arrivals = iter(jobs)
    pending = next(arrivals, None)
    by_departure = sorted((j.departure, j.id) for j in jobs if j.departure is not None)
    dep_k = 0
    held_s = 0.0
    over_min = 0.0
    peak = 0
    series: list[tuple[float, int, int]] = []
    overcommits: list[tuple[float, int, list[str]]] = []
    last_t, last_held = t0, 0
    departed_since_cycle = False
    n_cycles = 0
    job_s = 0.0
    for t in steps:
        t = float(t)
        held_s += last_held * (t - last_t)
        last_t = t
        # departures
        while dep_k < len(by_departure) and by_departure[dep_k][0] <= t:
            jid = by_departure[dep_k][1]
            dep_k += 1
            lv = live.pop(jid, None)
            if lv is None:
                continue
            job_s += t - lv.job.arrival
            _take(pk, lv)
            departed_since_cycle = True
        for lv in live.values():
            lv.advance(t)
        # arrivals
        while pending is not None and pending.arrival <= t:
            lv = _Live(pending)
            lv.advance(t)
            why = _arrive(pk, lv, p, t)
            if why:
                reasons[pending.id] = why
            else:
                live[pending.id] = lv
            pending = next(arrivals, None)
        # a job alone on its device whose memory outgrew the device is stopped (it could run nowhere)
        for jid, lv in list(live.items()):
            if lv.parts or jid not in pk.where:
                continue
            i = pk.where[jid]
            if pk.n_jobs[i] == 1 and lv.real_mem() > cap[i]:
                reasons[jid] = (f"its memory ({lv.real_mem() / 2**30:.1f} GiB) outgrew device {dev_ids[i]} "
                                f"({cap[i] / 2**30:.1f} GiB) at {t - t0:.0f} s")
                job_s += t - lv.job.arrival
                _take(pk, live.pop(jid))
        # overcommit: the real memory as it was read, before any move this step can make
        if has_series:
            mem = np.zeros(len(dev_ids))
            for jid, lv in live.items():
                if jid in pk.where:
                    mem[pk.where[jid]] += lv.real_mem()
            if t in sampled:
                over_min += float((mem > cap).sum()) * (trace.step_s or 60.0) / 60.0
                for i in np.flatnonzero(mem > cap):
                    overcommits.append((t, dev_ids[int(i)], sorted(pk.on.get(int(i), ()))))
        # the consolidation cycle; between cycles, a guard-only pass as soon as a co-located job's memory passes
        # what it was planned at (telemetry arrives every minute: this is what the agent would report)
        cycle = t in cycle_set and (has_series or departed_since_cycle)
        guard = not cycle and guard_every_sample and has_series and any(
            pk.n_jobs[pk.where[jid]] > 1 and lv.real_mem() > pk.sizes[jid].mem
            for jid, lv in live.items() if jid in pk.where and not lv.parts)
        if cycle or guard:
            n_cycles += cycle
            departed_since_cycle = departed_since_cycle and not cycle
            demands = []
            for jid, lv in live.items():
                if lv.parts:  # a multi-device job's devices stay its own
                    demands.extend(JobDemand(f"{jid}#{k}", dev_ids[i], declared_mem=int(lv.job.declared_mem or 0),
                                             declared_util=1.0, movable=False, whole=True, gpus=lv.job.gpus)
                                   for k, i in enumerate(lv.parts))
                elif jid in pk.where:
                    demands.append(lv.demand(dev_ids[pk.where[jid]]))
            # the devices in use, and as many empty ones as jobs might have to move off a shared device
            in_use = pk.positions_in_use
            sharing = int(pk.n_jobs[pk.n_jobs > 1].sum())
            empty = np.flatnonzero(pk.n_jobs == 0)[:sharing]
            subset = [devices[int(i)] for i in np.concatenate([in_use, empty])]
            plan = plan_consolidation(subset, demands, t, p, guard_only=not cycle)
            for m in plan.moves:
                live[m.job_id].moves.append(t)
                moves.append((t, m.job_id, m.from_device_id, m.to_device_id, m.reason))
            _sync(pk, plan.packing, pos_of)
            for jid, why in plan.unresolved.items():
                reasons[jid] = f"stopped at {t - t0:.0f} s: {why}"
                job_s += t - live[jid].job.arrival
                live.pop(jid)
            if cycle:
                series.append((t, int((pk.n_jobs > 0).sum()), plan.devices_needed))
        # measure
        held = int((pk.n_jobs > 0).sum())
        peak = max(peak, held)
        last_held = held
    for lv in live.values():
        job_s += t_end - lv.job.arrival
    span = max(t_end - t0, 1e-9)
    return ReplayResult(held_s / span, peak, held_s / 3600.0, moves, over_min, reasons, job_s / 86400.0, series,
                        n_cycles, overcommits)


def _take(pk: Packing, lv: _Live) -> None:
    if lv.parts:
        for k in range(len(lv.parts)):
            pk.take(f"{lv.job.id}#{k}")
    elif lv.job.id in pk.where:
        pk.take(lv.job.id)


def _sync(pk: Packing, planned: Packing, pos_of: dict[int, int]) -> None:
    """Make the replay's packing what the plan left: jobs that moved or were re-sized are put back as planned."""
    changed = []
    for jid, size in planned.sizes.items():
        at = pos_of[planned.fleet.devices[planned.where[jid]].device_id]
        if pk.where.get(jid) != at or pk.sizes.get(jid) != size:
            changed.append((jid, at, size))
    for jid, _, _ in changed:
        if jid in pk.where:
            pk.take(jid)
    for jid, at, size in sorted(changed, key=lambda c: c[2].shareable):  # whole devices are held first
        if not pk.put(at, size):
            raise AssertionError(f"the plan put {jid} on device position {at}, which the replay cannot hold")
    for jid in [j for j in pk.where if j not in planned.sizes]:
        pk.take(jid)  # a job the plan could not place is stopped by the caller


def _arrive(pk: Packing, lv: _Live, p: ConsolidateParams, now: float) -> str:
    """Place an arriving job; '' or the reason it cannot be placed."""
    job = lv.job
    if job.gpus > 1:
        parts = []
        for k in range(job.gpus):
            size = Size(f"{job.id}#{k}", int(job.declared_mem or 0), 1.0, False, "declared")
            i = pk.empty_device(size)
            if i is None or not pk.put(i, size):
                for q in range(len(parts)):
                    pk.take(f"{job.id}#{q}")
                return f"needs {job.gpus} whole devices; fewer are free"
            parts.append(i)
        lv.parts = parts
        return ""
    size = size_job(lv.demand(None), now, p)
    if size.why == "no_samples":
        size = Size(job.id, 0, 1.0, False, "no_samples")
    i, why = pk.place_new(size)
    return why if i is None else ""
