"""The fleet as the enforcer believes it is, read once per cycle, with the one rule for a device's free capacity.

Admission (`fleetlens run`), the planner, consolidation and the dashboard all start from a `FleetState`: the usable
devices with their memory and the memory no placement explains (`unmanaged`), the open lanes, the active and
pending placements with the memory they were admitted with, the lanes reserved for moves under way, and per placed
workflow whether it may be moved and which hosts can read its checkpoints. Nothing else in the enforcer computes
"capacity minus memory we do not manage": `FleetState.free_capacity` is the rule, and a property test checks that
every consumer ends up with the same number per device.

The rule: a device's free capacity is its memory less `unmanaged`, where `unmanaged` is the larger of what the latest
process samples show workflows not placed on it using, and what the latest device sample shows in use beyond what
its placements explain (a lane placement explains its P' + E plus its context C, the memory its process holds
outside the caching allocator, which NVML counts and admission charges beside the lane; a whole-device placement the
whole device, which is all its holder's; a lane opened for a job on its way, its share of the lane; a job on its
way into a lane others hold, the P' and E it was planned with). See
store.device_memory for the two views, and enforcer.lanes for C. A placement's C is its workflow's measured one
(store.device_memory.known_context), else its device's default: Settings.context_mb on NVML GPUs, 0 on `cpu` and
replayed devices (no CUDA context there, or one already inside the replayed figures).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field, replace

from sqlalchemy import select
from sqlalchemy.orm import Session

from store.checkpoints import readable_hosts_by_workflow
from store.device_memory import known_context, unplaced_memory
from store.headroom import charged
from store.models import Action, ActionEvent, Device, Lane, Placement, Team, Workflow
from store.registry import hosts_left_alone
from store.settings import Settings
from store.workflows import is_movable

# action states after which a move is over (the lanes it opened are no longer reserved for it)
MOVE_OVER = ("resumed", "rolled_back", "failed")
PLACED = ("active", "pending")


@dataclass(frozen=True, slots=True)
class DeviceState:
    device_id: int
    host: str
    kind: str  # the model name (policies match jobs to kinds)
    index: int
    memory_total: int  # bytes (0: unknown)
    unmanaged: int  # bytes in use that no placement explains: never handed out
    context_default: int = 0  # C charged a job on it whose own is not measured (enforcer.lanes)


@dataclass(frozen=True, slots=True)
class LaneState:
    lane_id: int
    device_id: int
    size: int
    compute_share: float


@dataclass(frozen=True, slots=True)
class PlacementState:
    """One job on one device, as admitted: `persistent` its measured P (None: its memory is unknown), `ephemeral`
    its E; `p_prime` the P' a lane charges it (the headroom applied by store.headroom, never stored)."""

    placement_id: int
    workflow_id: str
    device_id: int
    lane_id: int | None  # None: the whole device
    host: str
    pid: int | None
    persistent: int | None
    ephemeral: int | None
    compute_share: float | None
    state: str  # 'active' or 'pending'
    context: int | None = None  # C as measured (store.device_memory.known_context); None: the device's default

    @property
    def p_prime(self) -> int | None:
        return None if self.persistent is None else charged(self.persistent)


@dataclass(frozen=True, slots=True)
class Arriving:
    """A lane opened or joined for a job whose move is still under way: reserved for it whatever else happens."""

    workflow_id: str
    device_id: int
    lane: LaneState
    # bytes of the lane reserved for this job, as its P': in a lane no placed job holds, the lane split evenly among
    # those on their way; in a lane jobs already hold, the P' the move was planned with (`ephemeral` its E)
    share: int
    ephemeral: int = 0


@dataclass(frozen=True, slots=True)
class WorkflowState:
    workflow_id: str
    state: str
    managed: bool
    team: str | None
    movable: bool  # opted in (per workflow or team) and running
    # hosts that said lately they can read its checkpoint location; None: no storage facts were read
    readable_hosts: frozenset[str] | None


@dataclass
class FleetState:
    now: float
    devices: dict[int, DeviceState] = field(default_factory=dict)
    lanes: dict[int, LaneState] = field(default_factory=dict)
    placements: list[PlacementState] = field(default_factory=list)
    arriving: list[Arriving] = field(default_factory=list)
    workflows: dict[str, WorkflowState] = field(default_factory=dict)
    # hosts not heard from within Settings.host_silence_s, or Slurm nodes Slurm reports not answering, with why
    # (store.registry.silent_hosts): the planner and consolidation move nothing onto or off their devices (admission
    # still sees them; the dashboard's Fleet page names them, by the same rule: store.registry.hosts_left_alone)
    not_heard_from: dict[str, str] = field(default_factory=dict)
    # Slurm nodes that run their jobs on but take no new one (drained, draining, in maintenance, reserved), with why
    # (store.registry.closed_hosts; a host not heard from is named in not_heard_from only): the planner and
    # consolidation may move jobs off their devices, never onto them
    closed: dict[str, str] = field(default_factory=dict)

    def free_capacity(self, device_id: int) -> int:
        """The one rule: what admission may hand out on the device (lanes included), its memory less `unmanaged`."""
        d = self.devices[device_id]
        return max(0, d.memory_total - d.unmanaged)

    def context_charge(self, p: PlacementState) -> int:
        """C charged beside the lanes for a placement: none for a whole device (its lane holds it), else its
        measured C, else its device's default."""
        if p.lane_id is None:
            return 0
        return self.devices[p.device_id].context_default if p.context is None else p.context

    def placements_on(self, device_id: int, states: tuple[str, ...] = PLACED) -> list[PlacementState]:
        return [p for p in self.placements if p.device_id == device_id and p.state in states]

    def active(self) -> list[PlacementState]:
        return [p for p in self.placements if p.state == "active"]


def read_fleet_state(session: Session, *, now: float | None = None, settings: Settings | None = None,
                     host_id: str | None = None) -> FleetState:
    """Read the fleet once: every usable device (of `host_id` only, if given), its lanes, placements, moves under way,
    and, with `settings`, each placed workflow's movability (teams from FLEETLENS_MOVABLE_TEAMS too) and the hosts
    that can read its checkpoints (probes younger than `storage_probe_max_age_s`). Without `settings` the storage
    facts are left out (`readable_hosts` None), only the teams the store marks movable count, no device charges
    a default context and no host counts as silent (every caller that admits or plans passes its settings).

    With `settings`, the hosts not heard from within `host_silence_s` (store.registry.silent_hosts: an agent's
    heartbeat, or an importer's last record of the node; and a Slurm node whose latest listing shows it down or not
    responding) are named in `not_heard_from`, and the Slurm nodes that take no new job (drained, draining, in
    maintenance, reserved: store.registry.closed_hosts, both read by store.registry.hosts_left_alone) in `closed`;
    their devices stay in the state (admission and the dashboard show them as they are), the planner and
    consolidation leave the silent ones alone and move nothing onto the closed ones."""
    now = time.time() if now is None else now
    query = select(Device).where(Device.state == "ok")
    if host_id is not None:
        query = query.where(Device.host_id == host_id)
    rows = list(session.scalars(query.order_by(Device.id)))
    ids = [d.id for d in rows]
    state = FleetState(now=now)
    state.lanes = {lane.id: LaneState(lane.id, lane.device_id, int(lane.size_bytes), float(lane.compute_share))
                   for lane in session.scalars(select(Lane).where(Lane.device_id.in_(ids), Lane.state == "open"))}
    placed_rows = session.execute(
        select(Placement, Workflow).join(Workflow, Workflow.id == Placement.workflow_id)
        .where(Placement.device_id.in_(ids), Placement.state.in_(PLACED)).order_by(Placement.id)).all()
    state.placements = [PlacementState(
        p.id, p.workflow_id, p.device_id, p.lane_id, p.host_id, p.pid,
        None if p.mem_persistent is None else int(p.mem_persistent),
        None if p.mem_ephemeral is None else int(p.mem_ephemeral), p.compute_share, p.state, known_context(wf))
        for p, wf in placed_rows]
    state.arriving = _arriving(session, ids, state.placements)
    totals = {d.id: int(d.memory_total or 0) for d in rows}
    default = settings.context_bytes if settings is not None else 0
    # the device kinds whose jobs hold a CUDA context NVML counts: GPUs read through NVML
    state.devices = {d.id: DeviceState(d.id, d.host_id, d.name or "", d.index, totals[d.id], 0,
                                       default if d.source == "nvml" else 0) for d in rows}
    unmanaged = _unmanaged(session, state, totals)
    state.devices = {i: replace(d, unmanaged=unmanaged.get(i, 0)) for i, d in state.devices.items()}
    if settings is not None:
        hosts = {d.host_id for d in rows}
        state.not_heard_from, state.closed = hosts_left_alone(session, hosts, settings.host_silence_s, now)
    workflows = {wf.id: wf for _, wf in placed_rows}
    teams = set(session.scalars(select(Team.name).where(Team.movable.is_(True))))
    if settings is not None:
        teams |= set(settings.movable_teams)
        readable = readable_hosts_by_workflow(session, workflows.values(), max_age_s=settings.storage_probe_max_age_s,
                                              now=now)
    for wf in workflows.values():
        movable = is_movable(session, wf) or (bool(wf.managed) and wf.team in teams)
        state.workflows[wf.id] = WorkflowState(
            wf.id, wf.state, bool(wf.managed), wf.team, movable and wf.state == "running",
            readable[wf.id] if settings is not None else None)
    return state


def _arriving(session: Session, device_ids: list[int], placements: list[PlacementState]) -> list[Arriving]:
    rows = session.execute(
        select(Action.id, Action.workflow_id, Action.to_device_id, Lane)
        .join(Lane, Lane.id == Action.to_lane_id)
        .where(Action.state.not_in(MOVE_OVER), Lane.state == "open", Action.to_device_id.in_(device_ids))
        .order_by(Action.id)).all()
    per_lane: dict[int, int] = defaultdict(int)
    for _, _, _, lane in rows:
        per_lane[lane.id] += 1
    # lanes other jobs are placed in: a job joining one is held at its own P' and E, not at the whole lane
    coming = {(workflow_id, lane.id) for _, workflow_id, _, lane in rows}
    held = {p.lane_id for p in placements if p.lane_id is not None and (p.workflow_id, p.lane_id) not in coming}
    planned: dict[int, dict] = {}
    joining = [action_id for action_id, _, _, lane in rows if lane.id in held]
    if joining:
        for event in session.scalars(select(ActionEvent).where(ActionEvent.action_id.in_(joining),
                                                               ActionEvent.to_state == "planned")
                                     .order_by(ActionEvent.id.desc())):
            planned[event.action_id] = dict(event.detail or {})
    out = []
    for action_id, workflow_id, device_id, lane in rows:
        share, ephemeral = int(lane.size_bytes) // per_lane[lane.id], 0
        detail = planned.get(action_id, {})
        if lane.id in held and detail.get("p_prime") is not None:
            share, ephemeral = int(detail["p_prime"]), int(detail.get("ephemeral") or 0)
        out.append(Arriving(workflow_id, device_id,
                            LaneState(lane.id, lane.device_id, int(lane.size_bytes), float(lane.compute_share)),
                            share, ephemeral))
    return out


def _unmanaged(session: Session, state: FleetState, totals: dict[int, int]) -> dict[int, int]:
    """Per device, the bytes in use no placement explains (the module docstring says how)."""
    placed: dict[int, set[str]] = defaultdict(set)
    explained: dict[int, int] = defaultdict(int)
    for p in state.placements:
        placed[p.device_id].add(p.workflow_id)
        explained[p.device_id] += (p.p_prime or 0) + (p.ephemeral or 0) + state.context_charge(p) \
            if p.lane_id is not None else totals.get(p.device_id, 0)  # a whole device is all its holder's
    for a in state.arriving:
        if a.workflow_id not in placed[a.device_id]:  # not there yet: its share of the lane is spoken for
            explained[a.device_id] += a.share + a.ephemeral
    return unplaced_memory(session, list(totals), placed, explained)
