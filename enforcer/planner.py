"""The planner: from open waste findings and current placements, a plan of moves that frees whole devices.

Two halves. `plan_moves` is pure and in memory (devices and holdings in, moves out) so it plans for ten thousand
devices within a second and a simulator or benchmark can call it without a database. `make_plan`,
`apply_plan` and `load_state` read and write the store: plans are recorded in `plans`, and applying one creates
`actions` rows in state 'planned' that the migration state machine carries out later (nothing moves here).

How a plan is made: a device can be given back only if every job on it moves, so the planner empties whole
devices. A source device qualifies when each of its jobs is movable (managed, and movable per workflow or team),
flagged by an open finding (idle holder, low utilisation, over-provisioned memory), known in memory, and not in
its cool-down. Sources are tried from the easiest (fewest jobs, least memory); each job goes where the policy
places it under Salus's lane rule, on devices already in use only (moving onto an empty device frees nothing),
never on a device being emptied nor on one where processes outside fleetlens use memory. If one job of a device
finds no place, the device's moves are undone. At most `max_moves` moves per plan.

A job that holds a whole device but whose memory profile the SDK measured is taken to live in the lane Salus
would give it there, so others may be moved next to it; a job of unknown memory keeps its device to itself.
"""

from __future__ import annotations

import gc
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from enforcer.interference import InterferenceModel
from enforcer.lanes import PERSISTENT_FACTOR, Fleet, Job, Lane
from enforcer.policies import Policy, get_policy
from store.db import Store
from store.errors import InvalidInput, NotFound
from store.findings import open_findings
from store.models import Action, ActionEvent, Device, DeviceSample, Placement, Plan, Team, Workflow
from store.models import Lane as LaneRow
from store.settings import Settings, get_settings
from store.workflows import is_movable

# the analyzer's telemetry rules (analyzer/telemetry/*.py RULE) whose workflows are worth moving
PLANNER_RULES: tuple[str, ...] = ("idle_holder", "low_utilization", "memory_overprovisioned")
# action states after which a job may be planned again (once its cool-down has passed)
TERMINAL_ACTION_STATES = ("resumed", "rolled_back", "failed")
GIB = 2**30


@dataclass(slots=True)
class PlanDevice:
    device_id: int
    capacity: int
    host: str = ""
    kind: str = ""
    foreign: int = 0  # memory in use that no placement explains (other processes): never offered to lanes


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
    p_prime: int | None = None  # P' as admitted (placements.mem_persistent)
    movable: bool = False
    rules: tuple[str, ...] = ()  # open findings that make it worth moving
    cooling: bool = False  # moved recently or a move is under way


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


@dataclass
class PlanResult:
    policy: str
    moves: list[Move]
    devices_freed: list[int]
    skipped: dict[str, int] = field(default_factory=dict)  # why candidates were not moved, counted
    plan_id: int | None = None
    applied: bool = False

    def summary(self) -> dict[str, Any]:
        worst = max((m.expected_slowdown for m in self.moves), default=1.0)
        return {"moves": len(self.moves), "devices_freed": len(self.devices_freed),
                "freed_device_ids": self.devices_freed, "max_expected_slowdown": round(worst, 4),
                "skipped": self.skipped}


# ---------------------------------------------------------------------------------------------- the pure core


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
    fleet = Fleet()
    for d in devices:
        fleet.add_device(d.device_id, d.capacity, kind=d.kind, host=d.host)
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
        candidate[h.workflow_id] = (ok and spans[h.workflow_id] == 1 and h.movable and bool(h.rules)
                                    and h.persistent is not None and not h.cooling)
    for d in devices:
        if d.foreign > 0 and d.device_id in fleet.index_of:
            _hold_foreign(fleet, d)

    a = fleet.arrays
    a.alive[:] = a.n_jobs > 0  # targets are devices in use: moving onto an empty one frees nothing
    for d in devices:
        if d.foreign > 0 and d.device_id in fleet.index_of:
            # memory someone outside fleetlens uses can grow at any time: nobody is moved next to it
            a.alive[fleet.index_of[d.device_id]] = False
    sources = [d for d, jobs in residents.items() if jobs and all(candidate.get(j, False) for j in jobs)]
    sources.sort(key=lambda d: (len(residents[d]), fleet.device(d).reserved, d))
    targets: set[int] = set()
    freed: list[int] = []
    moves: list[Move] = []
    for source in sources:
        jobs = residents[source]
        if source in targets:
            continue
        if len(moves) + len(jobs) > max_moves:
            skipped["over the moves-per-cycle limit"] += len(jobs)
            continue
        placed = _evacuate(fleet, policy, source, [by_id[j] for j in jobs])
        if placed is None:
            skipped["no device has room"] += len(jobs)
            continue
        freed.append(source)
        for h, adm in placed:
            targets.add(adm.device_id)
            moves.append(Move(h.workflow_id, source, adm.device_id, None, None, 0, adm.p_prime, adm.ephemeral,
                              h.util, 1.0, 1.0, list(h.rules)))
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
    return PlanResult(policy.name, moves, freed, dict(skipped))


def _job(h: Holding) -> Job:
    return Job(h.workflow_id, persistent=h.persistent or 0, ephemeral=h.ephemeral, util=h.util)


def _place_holding(fleet: Fleet, h: Holding) -> bool:
    """Put a job back where it runs. A lane from the store as recorded; a whole-device holder with a known memory
    profile as if confined to the lane Salus would give it there; one of unknown memory holds the device whole."""
    device = fleet.device(h.device_id)
    job = _job(h)
    try:
        if h.lane_id is not None:
            size = h.lane_size if h.lane_size is not None else device.free
            fleet.place_loaded(job, h.device_id, h.lane_id, size, h.compute_share, p_prime=h.p_prime)
            return True
        if h.persistent is not None and fleet.add_to_new_lane(job, h.device_id) is not None:
            return True
        lane = device.add_lane(device.free, exclusive=not device.lanes)
        fleet.place_loaded(job, h.device_id, lane.lane_id, lane.size, p_prime=0 if lane.size == 0 else lane.size)
        return True
    except ValueError:
        return False


def _hold_foreign(fleet: Fleet, d: PlanDevice) -> None:
    device = fleet.device(d.device_id)
    size = min(max(0, d.foreign - device.reserved), device.free)
    if size > 0:
        lane = device.add_lane(size)
        fleet.place_loaded(Job(f"foreign:{d.device_id}"), d.device_id, lane.lane_id, size, p_prime=size)


def _evacuate(fleet: Fleet, policy: Policy, source: int, holdings: list[Holding]) -> list | None:
    """Move every job off `source`, or (if one cannot go anywhere) put everything back and return None."""
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
        admissions = policy.place(job, fleet)
        if admissions is None:
            for done, _ in placed:
                fleet.remove(done.workflow_id)
            for job0, lane, p_prime in before:
                fleet.place_loaded(job0, source, lane.lane_id, lane.size, lane.compute_share, p_prime=p_prime,
                                   exclusive=lane.exclusive)
            fleet.arrays.alive[i] = was_alive
            return None
        fleet.bind(admissions, job)
        placed.append((h, admissions[0]))
    return placed


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


# ---------------------------------------------------------------------------------------------- the store side


def load_state(session: Session, settings: Settings, now: float) -> tuple[list[PlanDevice], list[Holding]]:
    """Devices, current placements, open findings, movability and cool-downs, as `plan_moves` takes them."""
    latest = (select(DeviceSample.device_id, func.max(DeviceSample.ts).label("ts"))
              .group_by(DeviceSample.device_id).subquery())
    used = dict(session.execute(
        select(DeviceSample.device_id, DeviceSample.mem_used)
        .join(latest, (latest.c.device_id == DeviceSample.device_id) & (latest.c.ts == DeviceSample.ts))
    ).all())
    devices = [
        PlanDevice(d.id, int(d.memory_total or 0), d.host_id, d.name)
        for d in session.scalars(select(Device).where(Device.state == "ok").order_by(Device.id))
        if d.memory_total
    ]

    findings: dict[str, list] = defaultdict(list)
    for f in open_findings(session, rules=PLANNER_RULES):
        findings[f.workflow_id].append(f)
    busy = set(session.scalars(
        select(Action.workflow_id).where(
            (Action.state.not_in(TERMINAL_ACTION_STATES)) | (Action.updated_at >= now - settings.cooldown_s)
        )
    ))
    movable_teams = set(settings.movable_teams) | set(
        session.scalars(select(Team.name).where(Team.movable.is_(True))))

    rows = session.execute(
        select(Placement, Workflow, LaneRow)
        .join(Workflow, Workflow.id == Placement.workflow_id)
        .outerjoin(LaneRow, LaneRow.id == Placement.lane_id)
        .where(Placement.state == "active")
        .order_by(Placement.id)
    ).all()
    holdings = []
    explained: dict[int, int] = defaultdict(int)
    for placement, wf, lane in rows:
        flagged = findings.get(wf.id, [])
        persistent, ephemeral = _memory(wf, placement, flagged)
        movable = is_movable(session, wf) or (wf.managed and wf.team in movable_teams)
        holdings.append(Holding(
            workflow_id=wf.id, device_id=placement.device_id, persistent=persistent, ephemeral=ephemeral,
            util=_util(placement, lane, flagged), lane_id=lane.id if lane is not None else None,
            lane_size=lane.size_bytes if lane is not None else None,
            compute_share=lane.compute_share if lane is not None else 1.0, p_prime=placement.mem_persistent,
            movable=movable and wf.state == "running", rules=tuple(sorted({f.rule for f in flagged})),
            cooling=wf.id in busy,
        ))
        explained[placement.device_id] += (placement.mem_persistent or 0) + (placement.mem_ephemeral or 0)
    # lanes opened for moves still under way: reserved for the jobs on their way, whatever else happens
    arriving = session.execute(
        select(Action.workflow_id, Action.to_device_id, LaneRow)
        .join(LaneRow, LaneRow.id == Action.to_lane_id)
        .where(Action.state.not_in(TERMINAL_ACTION_STATES), LaneRow.state == "open")
        .order_by(Action.id)
    ).all()
    per_lane: dict[int, int] = defaultdict(int)
    for _, _, lane in arriving:
        per_lane[lane.id] += 1
    for workflow_id, device_id, lane in arriving:
        holdings.append(Holding(
            workflow_id=f"arriving:{workflow_id}", device_id=device_id, persistent=None, util=1.0,
            lane_id=lane.id, lane_size=lane.size_bytes, compute_share=lane.compute_share,
            p_prime=lane.size_bytes // per_lane[lane.id],
        ))
        explained[device_id] += lane.size_bytes // per_lane[lane.id]
    for d in devices:
        seen = used.get(d.device_id)
        if seen:
            d.foreign = max(0, int(seen) - explained[d.device_id])
    return devices, holdings


def _memory(wf: Workflow, placement: Placement, flagged: list) -> tuple[int | None, int]:
    """P and E: the SDK's memory profile, else what the placement admitted, else the peak a finding measured."""
    if wf.mem_persistent is not None:
        return int(wf.mem_persistent), int(wf.mem_ephemeral or 0)
    if placement.mem_persistent is not None:
        return int(placement.mem_persistent / PERSISTENT_FACTOR), int(placement.mem_ephemeral or 0)
    for f in flagged:
        gib = f.evidence.get("mem_peak_gib") or f.evidence.get("mem_held_gib")
        if gib:
            return int(float(gib) * GIB), 0
    return None, 0


def _util(placement: Placement, lane: LaneRow | None, flagged: list) -> float:
    for key in ("util_p95", "util_mean_while_idle", "util_mean"):
        for f in flagged:
            value = f.evidence.get(key)
            if value is not None:
                return max(0.0, min(1.0, float(value)))
    return float(placement.compute_share if lane is not None else 1.0)


def make_plan(store: Store, policy: str = "pack", *, apply: bool = False, settings: Settings | None = None,
              now: float | None = None) -> PlanResult:
    """Plan one cycle on the store's fleet and record it in `plans`; with `apply`, also create its actions."""
    settings = settings or get_settings()
    chosen = get_policy(policy)  # an unknown policy fails before anything is read or written
    now = time.time() if now is None else now
    with store.session() as session:
        devices, holdings = load_state(session, settings, now)
    result = plan_moves(devices, holdings, chosen, max_moves=settings.max_moves_per_cycle)
    with store.session() as session:
        row = Plan(created_at=now, policy=chosen.name, applied=False, devices_freed=len(result.devices_freed),
                   moves=[asdict(m) for m in result.moves], summary=result.summary())
        session.add(row)
        session.flush()
        result.plan_id = row.id
    if apply and result.moves:
        apply_plan(store, result.plan_id, now=now)
        result.applied = True
    return result


def apply_plan(store: Store, plan_id: int, *, now: float | None = None) -> list[Action]:
    """Turn a recorded plan into actions in state 'planned' (one per move) and open the lanes it needs.

    All or nothing: a plan that is unknown or already applied, or names a workflow that has gone, a job no
    longer where the plan found it, or a device that is gone, raises and leaves the store as it was.
    """
    now = time.time() if now is None else now
    with store.session() as session:
        plan = session.get(Plan, plan_id)
        if plan is None:
            raise NotFound(f"no plan {plan_id} in the store; `fleetlens enforce` makes one")
        if plan.applied:
            raise InvalidInput(f"plan {plan_id} was applied already; run `fleetlens enforce` for a fresh plan")
        moves = [Move(**m) for m in plan.moves]
        for m in moves:
            wf = session.get(Workflow, m.workflow_id)
            if wf is None:
                raise NotFound(f"plan {plan_id} moves workflow {m.workflow_id!r}, which is no longer in the store; "
                               "nothing was moved — run `fleetlens enforce` for a fresh plan")
            if wf.state != "running":
                raise InvalidInput(f"plan {plan_id} moves workflow {m.workflow_id!r}, which is {wf.state}; "
                                   "nothing was moved — run `fleetlens enforce` for a fresh plan")
            here = session.scalar(select(Placement.id).where(
                Placement.workflow_id == m.workflow_id, Placement.device_id == m.from_device_id,
                Placement.state == "active"))
            if here is None:
                raise InvalidInput(f"plan {plan_id}: workflow {m.workflow_id!r} is no longer on device "
                                   f"{m.from_device_id}; nothing was moved — run `fleetlens enforce` again")
            target = session.get(Device, m.to_device_id)
            if target is None or target.state != "ok":
                raise NotFound(f"plan {plan_id}: target device {m.to_device_id} is gone; nothing was moved")
        new_lanes: dict[str, int] = {}
        actions = []
        for m in moves:
            lane_id = m.to_lane_id
            if lane_id is None and m.new_lane is not None:
                if m.new_lane not in new_lanes:
                    lane = LaneRow(device_id=m.to_device_id, size_bytes=m.lane_size, compute_share=m.compute_share,
                                   state="open", created_at=now)
                    session.add(lane)
                    session.flush()
                    new_lanes[m.new_lane] = lane.id
                lane_id = new_lanes[m.new_lane]
            action = Action(plan_id=plan_id, kind="migrate", workflow_id=m.workflow_id, policy=plan.policy,
                            from_device_id=m.from_device_id, to_device_id=m.to_device_id, to_lane_id=lane_id,
                            state="planned", expected_slowdown=m.expected_slowdown, attempts=0,
                            created_at=now, updated_at=now)
            session.add(action)
            session.flush()
            session.add(ActionEvent(action_id=action.id, ts=now, from_state=None, to_state="planned",
                                    message=f"planned by plan {plan_id} ({plan.policy}): device {m.from_device_id} "
                                            f"-> {m.to_device_id}",
                                    detail={"rules": m.rules, "expected_slowdown": m.expected_slowdown,
                                            "lane_size": m.lane_size, "p_prime": m.p_prime,
                                            "ephemeral": m.ephemeral}))
            actions.append(action)
        plan.applied = True
        session.flush()
        for action in actions:
            session.refresh(action)
        session.expunge_all()
    return actions

