"""The planner's store side: read the fleet (devices, placements, open findings, movability, cool-downs) into the
pure planner's inputs, record a plan in `plans`, and apply one as `actions` rows in state 'planned' that the
migration state machine carries out later (nothing moves here)."""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import asdict

from sqlalchemy import select
from sqlalchemy.orm import Session

from enforcer.fleet_state import FleetState, LaneState, PlacementState, read_fleet_state
from enforcer.migration import MoveRefused, plan_action
from enforcer.move_checks import storage_refusal
from enforcer.planner import Holding, Move, PlanDevice, PlanResult, plan_moves
from enforcer.policies import get_policy
from store.db import Store
from store.device_memory import known_memory
from store.errors import InvalidInput, NotFound
from store.finding_contract import PLANNER_RULES, MoveEvidence
from store.findings import open_findings
from store.models import Action, Device, Placement, Plan, Workflow
from store.models import Lane as LaneRow
from store.settings import Settings

# action states after which a job may be planned again (once its cool-down has passed)
TERMINAL_ACTION_STATES = ("resumed", "rolled_back", "failed")
GIB = 2**30



def load_state(session: Session, settings: Settings, now: float) -> tuple[list[PlanDevice], list[Holding]]:
    """Devices, current placements, open findings, movability, cool-downs, and which hosts can read each job's
    checkpoint location, as `plan_moves` takes them, from the fleet state (enforcer.fleet_state)."""
    state = read_fleet_state(session, now=now, settings=settings)
    return plan_inputs(session, state, settings)


def plan_inputs(session: Session, state: FleetState, settings: Settings) -> tuple[list[PlanDevice], list[Holding]]:
    """The planner's inputs from a fleet state: each device's memory with what it does not manage (`foreign`: the
    planner holds it, so what it may hand out is the state's free capacity) and, for a host not heard from lately,
    why (`not_heard_from`: nothing is moved onto or off it), for a Slurm node that takes no new job, why (`closed`:
    nothing is moved onto it), and a holding per placement, active or pending (registered, not started yet: it holds
    its lane or device as admission gave it, and is not moved), and per job on its way into a lane."""
    now = state.now
    devices = [PlanDevice(d.device_id, d.memory_total, d.host, d.kind,
                          foreign=d.memory_total - state.free_capacity(d.device_id), context_default=d.context_default,
                          not_heard_from=state.not_heard_from.get(d.host), closed=state.closed.get(d.host))
               for d in state.devices.values() if d.memory_total]
    findings: dict[str, list] = defaultdict(list)
    for f in open_findings(session, rules=PLANNER_RULES):
        findings[f.workflow_id].append(f)
    busy = set(session.scalars(
        select(Action.workflow_id).where(
            (Action.state.not_in(TERMINAL_ACTION_STATES)) | (Action.updated_at >= now - settings.cooldown_s)
        )
    ))
    holdings = []
    for placement in state.placements:
        wf = session.get(Workflow, placement.workflow_id)
        facts = state.workflows[placement.workflow_id]
        lane = state.lanes.get(placement.lane_id) if placement.lane_id is not None else None
        flagged = findings.get(wf.id, [])
        persistent, ephemeral = _memory(session, wf, placement, flagged, settings.memory_seen_steps)
        holdings.append(Holding(
            workflow_id=wf.id, device_id=placement.device_id, persistent=persistent, ephemeral=ephemeral,
            util=_util(placement, lane, flagged), lane_id=lane.lane_id if lane is not None else None,
            lane_size=lane.size if lane is not None else None,
            compute_share=lane.compute_share if lane is not None else 1.0, p_prime=placement.p_prime,
            movable=facts.movable and placement.state == "active", rules=tuple(sorted({f.rule for f in flagged})),
            cooling=wf.id in busy,
            readable_hosts=facts.readable_hosts, context=placement.context,
        ))
    # lanes opened or joined by moves still under way: reserved for the jobs on their way (until they are there),
    # whatever else happens
    placed = {(p.workflow_id, p.lane_id) for p in state.placements}
    for a in state.arriving:
        if (a.workflow_id, a.lane.lane_id) in placed:
            continue  # there already: its placement holds it
        holdings.append(Holding(
            workflow_id=f"arriving:{a.workflow_id}", device_id=a.device_id, persistent=None, ephemeral=a.ephemeral,
            util=1.0, lane_id=a.lane.lane_id, lane_size=a.lane.size, compute_share=a.lane.compute_share,
            p_prime=a.share,
        ))
    return devices, holdings


def _memory(session: Session, wf: Workflow, placement: PlacementState, flagged: list,
            min_steps: int) -> tuple[int | None, int]:
    """P and E: declared, or seen long enough (SDK profile, NVML per-process memory); else what the placement
    admitted from such numbers; else the peak a finding measured. None: unknown, the job keeps its device alone."""
    known = known_memory(session, wf, min_steps)
    if known is not None:
        return known
    if placement.persistent is not None:
        return placement.persistent, int(placement.ephemeral or 0)
    for f in flagged:
        gib = MoveEvidence.from_json(f.evidence).memory_gib
        if gib:
            return int(float(gib) * GIB), 0
    return None, 0


def _util(placement: PlacementState, lane: LaneState | None, flagged: list) -> float:
    evidence = [MoveEvidence.from_json(f.evidence) for f in flagged]
    for key in MoveEvidence.UTIL_FIELDS:
        for ev in evidence:
            value = getattr(ev, key)
            if value is not None:
                return max(0.0, min(1.0, float(value)))
    return float(placement.compute_share if lane is not None else 1.0)


def make_plan(store: Store, policy: str = "pack", *, settings: Settings, apply: bool = False,
              now: float | None = None) -> PlanResult:
    """Plan one cycle on the store's fleet and record it in `plans`; with `apply`, also create its actions."""
    chosen = get_policy(policy)  # an unknown policy fails before anything is read or written
    now = time.time() if now is None else now
    with store.session() as session:
        devices, holdings = load_state(session, settings, now)
    result = plan_moves(devices, holdings, chosen, max_moves=settings.max_moves_per_cycle)
    with store.session() as session:
        explain_refusals(session, result.refused, settings, now)
    with store.session() as session:
        row = Plan(created_at=now, policy=chosen.name, applied=False, devices_freed=len(result.devices_freed),
                   moves=[asdict(m) for m in result.moves], summary=result.summary())
        session.add(row)
        session.flush()
        result.plan_id = row.id
    if apply and result.moves:
        apply_plan(store, result.plan_id, settings=settings, now=now)
        result.applied = True
    return result


def explain_refusals(session: Session, refusals: list[dict], settings: Settings, now: float) -> None:
    """Add to each job a planner (this one or consolidation) kept for want of readable storage why the host that
    had room cannot be used (what its agent said, or that it said nothing lately)."""
    for refusal in refusals:
        wf = session.get(Workflow, refusal["workflow_id"])
        source = session.get(Device, refusal["from_device_id"])
        why = None if wf is None or "to_host" not in refusal else storage_refusal(
            session, wf, source.host_id if source is not None else None, refusal["to_host"], settings, now=now)
        if why is not None:
            refusal["reason"] = f"{refusal['reason']}: {why}"


def apply_plan(store: Store, plan_id: int, *, settings: Settings, now: float | None = None) -> list[Action]:
    """Turn a recorded plan into actions in state 'planned' (one per move) and open the lanes it needs.

    All or nothing: a plan that is unknown or already applied, or names a workflow that has gone or a job no
    longer where the plan found it, or a move the plan-level checks refuse (enforcer.move_checks, run once per move
    as `plan_action` begins it: a device that is gone, a target without room, storage the target cannot read),
    raises and leaves the store as it was.
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
            try:
                action = plan_action(
                    session, m.workflow_id, plan.policy, m.from_device_id, m.to_device_id, lane_id, now=now,
                    message=f"planned by plan {plan_id} ({plan.policy}): device {m.from_device_id} -> {m.to_device_id}",
                    detail={"rules": m.rules, "expected_slowdown": m.expected_slowdown, "lane_size": m.lane_size,
                            "p_prime": m.p_prime, "ephemeral": m.ephemeral, "persistent": m.persistent},
                    settings=settings, plan_id=plan_id, expected_slowdown=m.expected_slowdown)
            except MoveRefused as refused:  # the session rolls back: nothing of the plan is written
                raise InvalidInput(f"plan {plan_id}: refused to move {m.workflow_id!r}: {refused.reason}; nothing "
                                   "was moved") from None
            actions.append(action)
        plan.applied = True
        session.flush()
        for action in actions:
            session.refresh(action)
        session.expunge_all()
    return actions

