"""The planner: from open waste findings and current placements, a plan of moves that frees whole devices.

`plan_moves` is pure and in memory (devices and holdings in, moves out) so it plans for ten thousand devices
within a second and a simulator or benchmark can call it without a database. Its store side (reading the fleet,
recording and applying plans) is enforcer.plan_store.

How a plan is made: a device can be given back only if every job on it moves, so the planner empties whole
devices. A source device qualifies when each of its jobs is movable (managed, and movable per workflow or team),
flagged by an open finding (idle holder, low utilisation, over-provisioned memory), known in memory, and not in
its cool-down. Sources are tried from the easiest (fewest jobs, least memory); each job goes where the policy
places it under Salus's lane rule, on devices already in use only (moving onto an empty device frees nothing),
never on a device being emptied nor on one where processes outside fleetlens use memory, never onto or off a device
of a host not heard from lately (`PlanDevice.not_heard_from`: its agent could neither start nor checkpoint the job,
or Slurm reports the node not answering; such jobs are counted in `skipped`, the hosts named in `not_heard_from`
with why), never onto a device of a Slurm node that takes no new job (`PlanDevice.closed`: drained, draining, in
maintenance or reserved; its jobs may still be moved off it, and the nodes are named in `closed`), and on another
host only when that host can read the job's checkpoint location (`Holding.readable_hosts`, facts the store side
passes in: which hosts' agents said so). If one job of a device finds no place, the device's moves are undone;
when the only places with room are on hosts that cannot read its checkpoints, the device is kept whole and the job
is named in `PlanResult.refused` with the reason. At most `max_moves` moves per plan.

A job that holds a whole device but whose memory profile the SDK measured is taken to live in the lane Salus
would give it there, so others may be moved next to it, into lanes of their own: nobody joins that lane, since its
job is in no lane of the store and takes no turns, so a lane-mate's ephemeral peak would come on top of its own. A
job of unknown memory keeps its device to itself.
"""

from __future__ import annotations

import gc
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any

from enforcer.interference import InterferenceModel
from enforcer.lane_fleet import Fleet
from enforcer.lanes import Admission, Job, Lane
from enforcer.policies import Policy, get_policy

NOT_HEARD_FROM = "on a host not heard from"  # the skipped-count key of jobs kept on a silent host
REFUSED_UNREADABLE = "refused: not safe to move"  # the skipped-count key of jobs kept for want of readable storage
UNREADABLE_REASON = ("only hosts that cannot read its checkpoint location have room for it; it runs on where it is "
                     "(give the fleet shared or object storage those hosts can read)")


def unreadable_refusal(workflow_id: str, from_device_id: int, to_device_id: int, to_host: str) -> dict[str, Any]:
    """A job kept where it runs because the device that had room for it is on a host that cannot read its
    checkpoint location (the planner's and consolidation's `refused` entries; the store side adds what the host's
    agent said)."""
    return {"workflow_id": workflow_id, "from_device_id": from_device_id, "to_device_id": to_device_id,
            "to_host": to_host, "reason": UNREADABLE_REASON}


@dataclass(slots=True)
class PlanDevice:
    device_id: int
    capacity: int
    host: str = ""
    kind: str = ""
    foreign: int = 0  # memory in use that no placement explains (other processes): never offered to lanes
    context_default: int = 0  # C charged beside its lanes to a job whose own is not measured (enforcer.lanes)
    # why its host is not heard from (enforcer.fleet_state): nothing is moved onto it nor off it; None: heard from
    not_heard_from: str | None = None
    # why its host takes no new job (a Slurm node drained, draining, in maintenance, reserved): nothing is moved onto
    # it, its jobs may be moved off; None: it takes jobs
    closed: str | None = None


@dataclass(slots=True)
class Holding:
    """One job where it runs now, as the planner needs to know it."""

    workflow_id: str
    device_id: int
    persistent: int | None  # P in bytes (None: unknown, the job can be neither moved nor confined to a lane)
    ephemeral: int = 0
    util: float = 1.0
    lane_id: int | None = None  # its lane in the store; None = it holds the device whole
    lane_size: int | None = None
    compute_share: float = 1.0
    p_prime: int | None = None  # P' as admitted: store.headroom.charged of placements.mem_persistent (P)
    movable: bool = False
    rules: tuple[str, ...] = ()  # open findings that make it worth moving
    cooling: bool = False  # moved recently or a move is under way
    # hosts besides its own that can read its checkpoint location (it may move only there or within its host);
    # None: no storage facts (a simulation), any host will do
    readable_hosts: frozenset[str] | None = None
    context: int | None = None  # C as measured (None: the device's default; 0: inside `persistent`)


@dataclass(slots=True)
class Move:
    workflow_id: str
    from_device_id: int
    to_device_id: int
    to_lane_id: int | None  # an existing lane; None = a lane this plan opens (new_lane names it)
    new_lane: str | None
    lane_size: int
    p_prime: int
    ephemeral: int
    util: float
    compute_share: float
    expected_slowdown: float
    rules: list[str]
    persistent: int | None = None  # the measured P that p_prime charges (None in plans recorded before it was kept)


@dataclass
class PlanResult:
    policy: str
    moves: list[Move]
    devices_freed: list[int]
    skipped: dict[str, int] = field(default_factory=dict)  # why candidates were not moved, counted
    plan_id: int | None = None
    applied: bool = False
    refused: list[dict[str, Any]] = field(default_factory=list)  # moves that cannot be made safely, with the reason
    not_heard_from: dict[str, str] = field(default_factory=dict)  # silent hosts and why: left alone
    closed: dict[str, str] = field(default_factory=dict)  # hosts that take no new job and why: no move onto them

    def summary(self) -> dict[str, Any]:
        worst = max((m.expected_slowdown for m in self.moves), default=1.0)
        return {"moves": len(self.moves), "devices_freed": len(self.devices_freed),
                "freed_device_ids": self.devices_freed, "max_expected_slowdown": round(worst, 4),
                "skipped": self.skipped, "refused": self.refused, "not_heard_from": self.not_heard_from,
                "closed": self.closed}


def plan_moves(devices: list[PlanDevice], holdings: list[Holding], policy: Policy | str = "pack",
               max_moves: int = 4, model: InterferenceModel | None = None) -> PlanResult:
    """Plan moves that empty whole devices (pure: nothing outside the arguments is read or changed)."""
    # tens of thousands of small long-lived objects are built here: the cyclic collector would only rescan them
    paused = gc.isenabled()
    gc.disable()
    try:
        return _plan_moves(devices, holdings, policy, max_moves, model)
    finally:
        if paused:
            gc.enable()


def _plan_moves(devices: list[PlanDevice], holdings: list[Holding], policy: Policy | str, max_moves: int,
                model: InterferenceModel | None) -> PlanResult:
    if isinstance(policy, str):
        policy = get_policy(policy) if model is None else get_policy(policy, model=model)
    skipped: dict[str, int] = defaultdict(int)
    silent = {d.device_id for d in devices if d.not_heard_from is not None}
    closed = {d.device_id for d in devices if d.closed is not None}
    fleet = Fleet()
    for d in devices:
        fleet.add_device(d.device_id, d.capacity, kind=d.kind, host=d.host, context_default=d.context_default)
    top = max((h.lane_id or 0 for h in holdings), default=0)
    fleet.use_lane_ids(top + 1)
    first_new = top + 1

    store_lanes = {h.lane_id for h in holdings if h.lane_id is not None}
    spans = defaultdict(int)
    for h in holdings:
        spans[h.workflow_id] += 1
    residents: dict[int, list[str]] = defaultdict(list)
    candidate: dict[str, bool] = {}
    by_id: dict[str, Holding] = {}
    # store lanes first, so whole-device holders confined to a lane see the memory those lanes take
    for h in sorted(holdings, key=lambda h: h.lane_id is None):
        if h.device_id not in fleet.index_of or h.workflow_id in by_id:
            continue  # a lost device, or a multi-device job seen twice: it stays where it is
        by_id[h.workflow_id] = h
        residents[h.device_id].append(h.workflow_id)
        ok = _place_holding(fleet, h)
        if not ok:
            skipped["placement inconsistent with memory"] += 1
        if h.rules and not h.movable:
            skipped["not movable"] += 1
        elif h.rules and h.persistent is None:
            skipped["memory unknown"] += 1
        elif h.rules and h.cooling:
            skipped["in cool-down"] += 1
        if spans[h.workflow_id] > 1:
            skipped["on several devices"] += 1
        if h.device_id in silent and h.rules and h.movable:
            skipped[NOT_HEARD_FROM] += 1  # its agent could not checkpoint it: the move would only stall
        candidate[h.workflow_id] = (ok and spans[h.workflow_id] == 1 and h.movable and bool(h.rules)
                                    and h.persistent is not None and not h.cooling and h.device_id not in silent)
    for d in devices:
        if d.foreign > 0 and d.device_id in fleet.index_of:
            _hold_foreign(fleet, d)

    a = fleet.arrays
    a.alive[:] = a.n_jobs > 0  # targets are devices in use: moving onto an empty one frees nothing
    for d in devices:
        if d.foreign > 0 and d.device_id in fleet.index_of:
            # memory someone outside fleetlens uses can grow at any time: nobody is moved next to it
            a.alive[fleet.index_of[d.device_id]] = False
        if (d.device_id in silent or d.device_id in closed) and d.device_id in fleet.index_of:
            # its agent could not start the job there, or Slurm starts no new job there
            a.alive[fleet.index_of[d.device_id]] = False
    sources = [d for d, jobs in residents.items() if jobs and all(candidate.get(j, False) for j in jobs)]
    sources.sort(key=lambda d: (len(residents[d]), fleet.device(d).reserved, d))
    targets: set[int] = set()
    freed: list[int] = []
    moves: list[Move] = []
    refused: list[dict[str, Any]] = []
    for source in sources:
        jobs = residents[source]
        if source in targets:
            continue
        if len(moves) + len(jobs) > max_moves:
            skipped["over the moves-per-cycle limit"] += len(jobs)
            continue
        placed, refusal = _evacuate(fleet, policy, source, [by_id[j] for j in jobs])
        if placed is None:
            if refusal is not None:
                skipped[REFUSED_UNREADABLE] += len(jobs)
                refused.append(refusal)
            else:
                skipped["no device has room"] += len(jobs)
            continue
        freed.append(source)
        for h, adm in placed:
            targets.add(adm.device_id)
            moves.append(Move(h.workflow_id, source, adm.device_id, None, None, 0, adm.p_prime, adm.ephemeral,
                              h.util, 1.0, 1.0, list(h.rules), persistent=h.persistent))
    # slowdowns and shares as they will be once every move is done
    for m in moves:
        device = fleet.device(m.to_device_id)
        lane = device.lane_of(m.workflow_id)
        assert lane is not None
        new = lane.lane_id >= first_new and lane.lane_id not in store_lanes
        m.to_lane_id, m.new_lane = (None, f"new-{lane.lane_id}") if new else (lane.lane_id, None)
        m.lane_size = lane.size
        m.compute_share = round(device.compute_shares()[lane.lane_id], 4)
        m.expected_slowdown = round(slowdown_in_place(fleet, m.workflow_id, policy.model), 4)
    return PlanResult(policy.name, moves, freed, dict(skipped), refused=refused,
                      not_heard_from={d.host: d.not_heard_from for d in devices if d.not_heard_from is not None},
                      closed={d.host: d.closed for d in devices if d.closed is not None})


def _job(h: Holding) -> Job:
    return Job(h.workflow_id, persistent=h.persistent or 0, ephemeral=h.ephemeral, util=h.util, context=h.context)


def _place_holding(fleet: Fleet, h: Holding) -> bool:
    """Put a job back where it runs. A lane from the store as recorded; a whole-device holder with a known memory
    profile as if confined to the lane Salus would give it there (nobody joins it: the job takes no turns); one of
    unknown memory holds the device whole."""
    device = fleet.device(h.device_id)
    job = _job(h)
    try:
        if h.lane_id is not None:
            size = h.lane_size if h.lane_size is not None else device.free
            fleet.place_loaded(job, h.device_id, h.lane_id, size, h.compute_share, p_prime=h.p_prime)
            return True
        if h.persistent is not None and fleet.add_to_new_lane(job, h.device_id, joinable=False) is not None:
            return True
        lane = device.add_lane(device.free, exclusive=not device.lanes)
        # it holds the rest of the device, its context included
        fleet.place_loaded(replace(job, context=0), h.device_id, lane.lane_id, lane.size,
                           p_prime=0 if lane.size == 0 else lane.size)
        return True
    except ValueError:
        return False


def _hold_foreign(fleet: Fleet, d: PlanDevice) -> None:
    device = fleet.device(d.device_id)
    size = min(max(0, d.foreign - device.reserved), device.free)
    if size > 0:
        lane = device.add_lane(size)
        # what others use, contexts and all: nothing is charged beside it
        fleet.place_loaded(Job(f"foreign:{d.device_id}", context=0), d.device_id, lane.lane_id, size, p_prime=size)


def _evacuate(fleet: Fleet, policy: Policy, source: int, holdings: list[Holding]
              ) -> tuple[list | None, dict[str, Any] | None]:
    """Move every job off `source`: (where each went, None). If one cannot go anywhere, everything is put back:
    (None, None) when no device has room, (None, the refusal) when the only room is on hosts that cannot read the
    job's checkpoint location."""
    device = fleet.device(source)
    before: list[tuple[Job, Lane, int]] = []
    for h in holdings:
        lane = device.lane_of(h.workflow_id)
        assert lane is not None
        before.append((fleet.job(h.workflow_id), lane, lane.jobs[h.workflow_id].p_prime))
    i = fleet.index_of[source]
    was_alive = bool(fleet.arrays.alive[i])
    fleet.arrays.alive[i] = False
    for job, _, _ in before:
        fleet.remove(job.job_id)
    placed = []
    # the biggest first: they are the hardest to fit
    for h, (job, _, _) in sorted(zip(holdings, before, strict=True), key=lambda x: -x[1][2]):
        admissions = _place_where_readable(fleet, policy, job, h, device.host)
        if admissions is None:
            refusal = None
            elsewhere = policy.place(job, fleet) if h.readable_hosts is not None else None
            if elsewhere is not None:
                target = fleet.device(elsewhere[0].device_id)
                refusal = unreadable_refusal(h.workflow_id, source, target.device_id, target.host)
            for done, _ in placed:
                fleet.remove(done.workflow_id)
            for job0, lane, p_prime in before:
                fleet.place_loaded(job0, source, lane.lane_id, lane.size, lane.compute_share, p_prime=p_prime,
                                   exclusive=lane.exclusive, joinable=lane.joinable)
            fleet.arrays.alive[i] = was_alive
            return None, refusal
        fleet.bind(admissions, job)
        placed.append((h, admissions[0]))
    return placed, None


def _place_where_readable(fleet: Fleet, policy: Policy, job: Job, h: Holding, home: str) -> list[Admission] | None:
    """The policy's place for the job among the devices of its own host and of hosts that can read its checkpoint
    location (every device when the holding carries no storage facts). The fleet is unchanged."""
    if h.readable_hosts is None:
        return policy.place(job, fleet)
    a = fleet.arrays
    alive = a.alive.copy()
    a.alive &= fleet.host_mask(h.readable_hosts | {home})
    try:
        return policy.place(job, fleet)
    finally:
        a.alive[:] = alive


def slowdown_in_place(fleet: Fleet, job_id: str, model: InterferenceModel) -> float:
    """Expected slowdown of a placed job: turns in its lane times interference from its device's other lanes."""
    (device_id, lane_id), *_ = fleet.where(job_id)
    device = fleet.device(device_id)
    lane = device.lanes[lane_id]
    if lane.exclusive:
        return 1.0
    in_lane = max(1.0, sum(j.util for j in lane.jobs.values()))
    others = device.demand - lane.demand
    util = lane.jobs[job_id].util
    return in_lane * (1.0 / model.speed(util, min(1.0, others)) if others > 0 else 1.0)
