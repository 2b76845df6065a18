"""Consolidation: re-pack movable jobs by the demand telemetry has shown so far, with few moves, so devices come free.

Pure and in memory (devices, placements and each job's observed history in; moves out), so the live cycle and the
simulator run the same code. Nothing here sees the future: a job is sized from its samples up to `now` only.
Jobs are sized by enforcer.consolidation_sizing (recent peak memory, p95 compute, whether a job may share).

Planning keeps placements. Guard moves first: on a shared device whose jobs' lanes no longer fit (a job's memory
grew toward its share) or whose jobs ask more compute than `util_cap`, the cheapest jobs move off until it fits,
before real memory runs out. Only jobs that opted in move: the others are the last to be chosen, and one that still
does not fit stays where it is (named in `unresolved`), its device neither drained nor filled. Then consolidation
moves, the device cheapest to drain first (fewest jobs, then least work lost): a device is emptied only if all its
jobs fit on other devices in use (Salus's lane rule, the compute cap) and the device-hours that returns over
`horizon_s` outweigh the moves' cost (downtime plus the work since each job's last checkpoint). Moves per cycle
and per job per day are capped; a device is never planned over its memory.

Storage. Like the planner (enforcer.planner), a job carrying storage facts (`JobDemand.readable_hosts`, which the
store side reads from the agents' probes) moves only within its own host or to a host that can read its checkpoint
location. When the only device with room is elsewhere, the move is not planned: a guard move's job stays where it
is, a device that would need such a move is not emptied, and the job is named in `ConsolidationPlan.refused` with
the reason. Without storage facts (the simulator) any device will do.

Silent hosts. The devices of a host not heard from lately (`not_heard_from`, which the store side reads with the
fleet state) are neither drained nor filled: its agent could not checkpoint a job there nor start one, so such a
move would only stall until its commands time out. Their movable jobs are counted in `ConsolidationPlan.skipped`.
The devices of a Slurm node that takes no new job (`closed`: drained, draining, in maintenance, reserved) are never
filled, and may be drained: moving its jobs off is what draining it is for.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from enforcer.consolidation_sizing import ConsolidateParams, JobDemand, Size, size_jobs
from enforcer.lane_fleet import Fleet
from enforcer.lanes import Admission, Job, lane_request
from enforcer.planner import NOT_HEARD_FROM, unreadable_refusal
from store.headroom import LANE_FACTOR, PERSISTENT_FACTOR

DAY_S = 86400.0


@dataclass(frozen=True, slots=True)
class ConsolidationMove:
    job_id: str
    from_device_id: int
    to_device_id: int
    reason: str  # guard_memory | guard_compute | free_device
    cost_s: float  # downtime plus lost work
    gain_device_h: float  # device-hours the move's group returns over the horizon (0 for guard moves)


@dataclass(slots=True)
class ConsolidationPlan:
    moves: list[ConsolidationMove]
    sizes: dict[str, Size]
    devices_held: int  # devices holding a job now
    devices_needed: int  # devices holding a job once the moves are done
    devices_freed: list[int]
    unresolved: dict[str, str]  # job -> why it has no place (no room anywhere)
    packing: Packing | None = None  # the devices once the moves are done
    # jobs kept where they run because the only room was on hosts that cannot read their checkpoint location
    refused: list[dict[str, Any]] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)  # movable jobs left where they are, counted by why
    not_heard_from: dict[str, str] = field(default_factory=dict)  # silent hosts and why: left alone
    closed: dict[str, str] = field(default_factory=dict)  # hosts that take no new job and why: no move onto them

    def summary(self) -> dict:
        reasons: dict[str, int] = {}
        for m in self.moves:
            reasons[m.reason] = reasons.get(m.reason, 0) + 1
        return {"moves": len(self.moves), "by_reason": reasons, "devices_held": self.devices_held,
                "devices_needed": self.devices_needed, "devices_freed": len(self.devices_freed),
                "unresolved": len(self.unresolved), "refused": self.refused, "skipped": self.skipped,
                "not_heard_from": self.not_heard_from, "closed": self.closed}



def lane_bytes(size: Size, capacity: int) -> int:
    """Memory the job's lane asks on a device of `capacity` (a whole device when it may not share); more than
    `capacity` when Salus's headroom does not fit there (then the job can only hold the device whole)."""
    if not size.shareable:
        return capacity
    return lane_request(size.mem, 0, 1 << 62)[1]


def fits_alone(size: Size, capacity: int) -> bool:
    """A job whose memory fits the device gets it alone, without Salus's headroom."""
    return size.mem <= capacity


class Packing:
    """Devices, who is where and how much memory and compute each holds: the state plans and simulations change.

    Memory goes through Salus's admission (enforcer.lane_fleet.Fleet): each shareable job opens its own lane, a job
    that may not share holds its device whole. Compute is the sum of the jobs' p95 utilisation per device.
    `hosts` names each device's host (device id -> host) where moves must respect storage.
    """

    def __init__(self, devices: list[tuple[int, int]], util_cap: float = 1.0,
                 hosts: Mapping[int, str] | None = None) -> None:
        self.util_cap = util_cap
        self.fleet = Fleet()
        for device_id, capacity in devices:
            self.fleet.add_device(device_id, capacity, host=(hosts or {}).get(device_id, ""))
        n = len(devices)
        self.util = np.zeros(n)
        self.n_jobs = np.zeros(n, dtype=np.int64)
        self.where: dict[str, int] = {}  # job -> device position
        self.on: dict[int, set[str]] = {}  # device position -> its jobs
        self.sizes: dict[str, Size] = {}
        self.capacity = self.fleet.arrays.capacity

    def reachable(self, readable_hosts: frozenset[str] | None, home: int) -> np.ndarray | None:
        """The devices a job on position `home` may move to: those of its own host and of the hosts that can read
        its checkpoint location (None: no storage facts, every device)."""
        if readable_hosts is None:
            return None
        return self.fleet.host_mask(readable_hosts | {self.fleet.devices[home].host})

    def refusal(self, job_id: str, home: int, size: Size, exclude: set[int] | frozenset[int],
                worst: bool = False, alone: bool = False) -> dict[str, Any] | None:
        """The refusal to record when a job found no device among those it may move to: the device that would
        have taken it had storage not mattered, on a host that cannot read its checkpoints (None: none had room)."""
        to = self.best_shared(size, exclude, worst)
        if to is None and alone:
            to = self.empty_device(size)
        if to is None:
            return None
        target = self.fleet.devices[to]
        return unreadable_refusal(job_id, self.fleet.devices[home].device_id, target.device_id, target.host)

    @property
    def positions_in_use(self) -> np.ndarray:
        return np.flatnonzero(self.n_jobs > 0)

    def admission(self, i: int, size: Size) -> Admission | None:
        device = self.fleet.devices[i]
        if not size.shareable:
            return device.admit_whole(Job(size.job_id, persistent=0, context=0)) \
                if fits_alone(size, device.capacity) else None
        adm = device.admit(size.lane_job(), whole=False)
        if adm is None or not adm.new_lane:
            return None  # own lane only: jobs of one lane take turns, which co-located services do not
        return adm

    def put(self, i: int, size: Size, adm: Admission | None = None) -> bool:
        adm = adm or self.admission(i, size)
        if adm is None:
            return False
        job = Job(size.job_id, persistent=0 if not size.shareable else size.mem, util=size.util,
                  exclusive=not size.shareable, context=0)
        self.fleet.bind([adm], job)
        self.where[size.job_id] = i
        self.on.setdefault(i, set()).add(size.job_id)
        self.sizes[size.job_id] = size
        self.util[i] += size.util
        self.n_jobs[i] += 1
        return True

    def take(self, job_id: str) -> int:
        i = self.where.pop(job_id)
        self.on[i].discard(job_id)
        size = self.sizes.pop(job_id)
        self.fleet.remove(job_id)
        self.util[i] -= size.util
        self.n_jobs[i] -= 1
        if self.n_jobs[i] == 0:
            self.util[i] = 0.0
        return i

    def best_shared(self, size: Size, exclude: set[int] | frozenset[int] = frozenset(), worst: bool = False,
                    allowed: np.ndarray | None = None) -> int | None:
        """The in-use shareable device with the least free memory left after the job's lane (best fit; `worst`:
        the most, where a job that had to move because its memory grew is least likely to run out again), among
        the `allowed` devices (a mask; None: all)."""
        if not size.shareable:
            return None
        a = self.fleet.arrays
        need = max(1, math.ceil(LANE_FACTOR * math.ceil(PERSISTENT_FACTOR * size.mem)))
        mask = (self.n_jobs > 0) & (a.free >= need) & (self.util + size.util <= self.util_cap + 1e-9) & (a.n_lanes > 0)
        if allowed is not None:
            mask &= allowed
        idx = np.flatnonzero(mask)
        if idx.size == 0:
            return None
        order = idx[np.argsort(a.free[idx] - need if not worst else need - a.free[idx], kind="stable")]
        for i in order:
            i = int(i)
            if i in exclude:
                continue
            if self.admission(i, size) is not None:
                return i
        return None

    def empty_device(self, size: Size, allowed: np.ndarray | None = None) -> int | None:
        """The smallest empty device that holds the job alone (among the `allowed` devices; None: all)."""
        a = self.fleet.arrays
        mask = (self.n_jobs == 0) & (a.capacity >= size.mem) & a.alive
        idx = np.flatnonzero(mask if allowed is None else mask & allowed)
        if idx.size == 0:
            return None
        return int(idx[np.argmin(a.capacity[idx])])

    def place_new(self, size: Size, exclude: set[int] | frozenset[int] = frozenset(), worst: bool = False,
                  allowed: np.ndarray | None = None) -> tuple[int | None, str]:
        """Where a job goes: next to others if it may share and a device in use has room, else a device alone
        (in its own lane when Salus's headroom fits there, so others may join it later; else whole), among the
        `allowed` devices (None: all).

        Returns (position, "") or (None, the reason it cannot be placed now)."""
        i = self.best_shared(size, exclude, worst, allowed)
        if i is not None:
            self.put(i, size)
            return i, ""
        i = self.empty_device(size, allowed)
        if i is not None:
            cap = int(self.capacity[i])
            alone = size if size.shareable and lane_bytes(size, cap) <= cap else Size(
                size.job_id, size.mem, size.util, False, size.why)
            if self.put(i, alone):
                return i, ""
        biggest = int(self.capacity.max()) if len(self.capacity) else 0
        if size.mem > biggest:
            return None, (f"needs {size.mem / 2**30:.1f} GiB, more than the largest device "
                          f"({biggest / 2**30:.1f} GiB) holds")
        return None, "no free device that fits it"


def plan_consolidation(devices: list[tuple[int, int]], demands: list[JobDemand], now: float,
                       params: ConsolidateParams | None = None, *, guard_only: bool = False,
                       hosts: Mapping[int, str] | None = None,
                       not_heard_from: Mapping[str, str] | None = None,
                       closed: Mapping[str, str] | None = None) -> ConsolidationPlan:
    """Moves for one cycle: guard moves for devices running out, then (unless `guard_only`: a check between
    cycles when a job's memory passed what it was planned at) moves that free whole devices. `hosts` (device id
    -> host) with the jobs' `readable_hosts` keeps every move where the job's checkpoints can be read;
    `not_heard_from` (host -> why) names the silent hosts, whose devices are neither drained nor filled (their
    agents could neither checkpoint a job nor start one); `closed` (host -> why) the hosts that take no new job,
    whose devices are never filled but may be drained."""
    p = params or ConsolidateParams()
    pk = Packing(devices, p.util_cap, hosts)
    sizes = size_jobs(demands, now, p)
    by_id = {d.job_id: d for d in demands}
    pos_of = pk.fleet.index_of
    silent = dict(not_heard_from or {})
    quiet = {pos_of[d] for d, host in (hosts or {}).items() if host in silent and d in pos_of}
    shut = dict(closed or {})
    # devices no job goes to, empty or not: a silent host's, and a closed one's (whose jobs may still leave)
    no_target = quiet | {pos_of[d] for d, host in (hosts or {}).items() if host in shut and d in pos_of}
    for i in no_target:
        pk.fleet.arrays.alive[i] = False

    # a move's cost: its downtime plus the work since the job's last checkpoint
    costs = {d.job_id: p.downtime_s + max(0.0, d.since_checkpoint_s) for d in demands}

    # load the current placement device by device; what no longer fits is over
    over: list[tuple[int, str, str]] = []  # (device position, job, guard reason)
    groups: dict[int, list[JobDemand]] = {}
    for d in demands:
        if d.device_id is not None and d.device_id in pos_of:
            groups.setdefault(pos_of[d.device_id], []).append(d)
    unresolved: dict[str, str] = {}
    for i, members in groups.items():
        cap = int(pk.capacity[i])
        if len(members) == 1:
            s = sizes[members[0].job_id]
            alone = s if (s.shareable and lane_bytes(s, cap) <= cap) else Size(s.job_id, s.mem, s.util, False, s.why)
            if not pk.put(i, alone):
                unresolved[s.job_id] = "its memory outgrew the device it runs on alone"
            continue
        # a shared device: jobs that may not move stay, then the costliest to move; the cheapest move off until the
        # rest fit
        members.sort(key=lambda d: (d.movable, -costs[d.job_id], -sizes[d.job_id].mem, d.job_id))
        for d in members:
            s = sizes[d.job_id]
            in_lane = Size(s.job_id, s.mem, s.util, True, s.why)  # co-located already: it keeps a lane
            if pk.util[i] + s.util > max(p.util_cap, p.util_guard) + 1e-9:
                over.append((i, d.job_id, "guard_compute"))
            elif not pk.put(i, in_lane):
                over.append((i, d.job_id, "guard_memory"))
    held = len(groups)
    moves: list[ConsolidationMove] = []
    moved: set[str] = set()
    refused: list[dict[str, Any]] = []
    # devices neither drained nor filled: where a job that could not go stays over its share, and a silent host's
    kept: set[int] = set(quiet)
    skipped: dict[str, int] = {}
    left = sum(1 for d in demands if d.movable and d.device_id in pos_of and pos_of[d.device_id] in quiet)
    if left:
        skipped[NOT_HEARD_FROM] = left
    # guard moves: they go now, whatever the caps, to the device with the most room (shared if the job may share,
    # else alone) among those whose host can read its checkpoints
    for i, job_id, reason in over:
        if i in quiet:
            unresolved[job_id] = "over its share of a shared device, on a host not heard from lately"
            continue
        if not by_id[job_id].movable:
            # not opted in to be moved (or a part of a multi-device job): it runs on where it is, over its share
            unresolved[job_id] = "over its share of a shared device, and it may not be moved"
            kept.add(i)
            continue
        allowed = pk.reachable(by_id[job_id].readable_hosts, i)
        to, _ = pk.place_new(sizes[job_id], exclude=kept | no_target | {i}, worst=True, allowed=allowed)
        if to is None:
            refusal = None if allowed is None else pk.refusal(job_id, i, sizes[job_id], kept | no_target | {i},
                                                               worst=True, alone=True)
            if refusal is not None:
                refused.append(refusal)  # it stays where it is: better short of memory than its work lost
                kept.add(i)
            else:
                unresolved[job_id] = "no device has room for it"
            continue
        moves.append(ConsolidationMove(job_id, pk.fleet.devices[i].device_id, pk.fleet.devices[to].device_id,
                                       reason, costs[job_id], 0.0))
        moved.add(job_id)
    # consolidation moves: empty whole devices, easiest first, onto devices in use
    budget = 0 if guard_only else p.max_moves_per_cycle - len(moves)
    freed: list[int] = []

    def may_move(d: JobDemand) -> bool:
        recent = sum(1 for t in d.moves if t > now - DAY_S)
        return (d.movable and d.gpus == 1 and d.job_id not in moved and sizes[d.job_id].shareable
                and recent < p.max_moves_per_job_day)

    in_use = pk.positions_in_use
    a = pk.fleet.arrays
    # the cheapest devices to drain first: fewest jobs, then least work lost by moving them, then most free memory
    drain_cost = np.zeros(len(pk.n_jobs))
    for j, i in pk.where.items():
        drain_cost[i] += costs.get(j, 0.0)
    order = in_use[np.lexsort((in_use, -a.free[in_use], drain_cost[in_use], pk.n_jobs[in_use]))].tolist()
    emptied: set[int] = set()
    for i in order:
        if budget <= 0:
            break
        members = sorted(pk.on.get(i, ()))
        if not members or i in kept or len(members) > budget or not all(may_move(by_id[j]) for j in members):
            continue
        total_cost = sum(costs[j] for j in members)
        gain_s = p.horizon_s
        if total_cost >= gain_s:
            continue
        taken = [(j, pk.sizes[j]) for j in members]
        for j, _ in taken:
            pk.take(j)
        targets: list[tuple[str, int]] = []
        for j, s in sorted(taken, key=lambda x: -x[1].mem):
            allowed = pk.reachable(by_id[j].readable_hosts, i)
            to = pk.best_shared(s, exclude=emptied | kept | no_target | {i}, allowed=allowed)
            if to is None:
                refusal = None if allowed is None else pk.refusal(j, i, s, emptied | kept | no_target | {i})
                if refusal is not None:
                    refused.append(refusal)
                break
            pk.put(to, s)
            targets.append((j, to))
        if len(targets) < len(taken):
            for j, _ in targets:
                pk.take(j)
            for _j, s in taken:
                pk.put(i, s)
            continue
        emptied.add(i)
        freed.append(pk.fleet.devices[i].device_id)
        gain_h = gain_s / 3600.0
        for j, to in targets:
            moves.append(ConsolidationMove(j, pk.fleet.devices[i].device_id, pk.fleet.devices[to].device_id,
                                           "free_device", costs[j], gain_h / len(targets)))
            moved.add(j)
        budget -= len(targets)
    return ConsolidationPlan(moves, sizes, held, int((pk.n_jobs > 0).sum()), freed, unresolved, pk, refused,
                             skipped, silent, shut)
