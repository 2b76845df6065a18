"""The plan-level checks of a move, defined once and run once: may this job be moved from its host to that one now?

A plan-level check looks at the fleet's facts, not at the job's bytes: the target device is there and usable, the
target (its lane, or the whole device) has room for the job as admitted (Salus's rule, `enforcer.lanes`, counting the
jobs placed there and those already on their way), both hosts were heard from lately (`Settings.host_silence_s`: a
silent source's agent could not checkpoint the job, a silent target's could not start it; a Slurm node Slurm reports
down or not responding is not heard from), the target host takes new jobs (not a Slurm node drained, draining, in
maintenance or reserved; a job may leave one), and the target host said
lately that it can read and write the job's checkpoint location (else the job could not resume there).
`move_refusal` is the one entry; it runs once per move, where the move is begun: `enforcer.migration.plan_action`
calls it before it records the action, for a plan's moves (`apply_plan`) and a move by hand (`start_migration`)
alike, and a refused move is never recorded, so no actuator ever receives it. The planner plans around the same facts
as it reads them with the fleet (`FleetState.workflows[...].readable_hosts`, `FleetState.not_heard_from`, free
capacity), and `explain_refusals` uses `storage_refusal` only to say why the planner kept a job where it was.

Facts can change between the moment a move is begun (the check) and the moment the actuator places the job, and the
check does not run again: it runs when the move is begun, which for a plan's moves is when the plan is applied, not
when the actuator takes its first step. The target stays reserved in between because admission and the planner hold
a lane opened for a move under way for the job on its way (`FleetState.arriving`); a host whose storage fails after
the check fails the relaunch there, which the actuator rolls back, and a host that falls silent after it is noticed
by the agents' state machine at its next step, by the same rule (enforcer.move_silence).

What belongs to execution (the relaunch spec matches its signature, the checkpoint's size and sha256, its age when
the job stops, the resume step at or above the checkpoint's) is checked inside the actuator
(enforcer.actuators.agents and the agent it commands), never here.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from enforcer.lanes import lane_fits, whole_device_fits
from store.checkpoints import unreadable_reason
from store.device_memory import known_context
from store.headroom import charged
from store.models import Action, ActionEvent, Device, Lane, Placement, Workflow
from store.registry import closed_hosts, silent_hosts
from store.settings import Settings

MOVE_OVER = ("resumed", "rolled_back", "failed")
PLACED = ("active", "pending")


def target_refusal(target: Device | None, to_device_id: int) -> str | None:
    """Why the target device cannot take anything (None when it can)."""
    if target is None or target.state != "ok":
        return f"target device {to_device_id} is gone (not in the store, or lost)"
    return None


def silence_refusal(session: Session, source_host: str | None, target_host: str, settings: Settings, *,
                    now: float) -> str | None:
    """Why a host of the move has gone silent (None when both were heard from within `host_silence_s`): the same
    rule the planner plans by (enforcer.fleet_state), checked again when the move is begun, for a plan applied later
    and a move by hand."""
    roles = {target_host: "start the job there"}
    if source_host is not None:
        roles[source_host] = "checkpoint the job" if source_host != target_host else "checkpoint or start the job"
    silent = silent_hosts(session, roles, settings.host_silence_s, now)
    for host, role in roles.items():
        if host in silent:
            return f"{silence_phrase(host, silent[host])}; its agent could not {role}"
    return None


def closed_refusal(session: Session, target_host: str) -> str | None:
    """Why the target host takes no new job (None when it does): a Slurm node drained, draining, in maintenance or
    reserved (store.registry.closed_hosts), the same rule the planner plans by. The source may be one."""
    why = closed_hosts(session, [target_host]).get(target_host)
    return None if why is None else f"host {target_host} {why}; nothing is moved onto it"


def silence_phrase(host: str, why: str) -> str:
    """How a silent host (store.registry.silent_hosts: `why` is its reason) is named, when a move is refused for it
    and when a move under way gives up for it (enforcer.move_silence)."""
    return f"host {host} {why}"


def storage_refusal(session: Session, wf: Workflow, source_host: str | None, target_host: str, settings: Settings,
                    *, now: float) -> str | None:
    """Why the target host cannot be trusted to read `wf`'s checkpoints (None when it can); probes older than
    `storage_probe_max_age_s` do not count."""
    return unreadable_reason(session, wf, source_host, target_host, max_age_s=settings.storage_probe_max_age_s,
                             now=now)


def move_refusal(session: Session, wf: Workflow | None, from_device_id: int, to_device_id: int,
                 to_lane_id: int | None, p_prime: int, ephemeral: int, settings: Settings, *,
                 now: float) -> str | None:
    """The plan-level check of one move (None: it may be begun): target usable, target capacity for a job of
    charged P' `p_prime` and E `ephemeral`, both hosts heard from lately, the target host taking new jobs,
    checkpoint storage readable from the target host."""
    if wf is None:
        return "the workflow is gone"
    target = session.get(Device, to_device_id)
    refusal = target_refusal(target, to_device_id)
    if refusal is not None:
        return refusal
    refusal = capacity_refusal(session, wf, target, from_device_id, to_lane_id, p_prime, ephemeral, settings)
    if refusal is not None:
        return refusal
    source = session.get(Device, from_device_id)
    refusal = silence_refusal(session, source.host_id if source is not None else None, target.host_id, settings,
                              now=now) or closed_refusal(session, target.host_id)
    if refusal is not None:
        return refusal
    return storage_refusal(session, wf, source.host_id if source is not None else None, target.host_id, settings,
                           now=now)


def capacity_refusal(session: Session, wf: Workflow, target: Device, from_device_id: int,
                     to_lane_id: int | None, p_prime: int, ephemeral: int, settings: Settings) -> str | None:
    """Why the target lane (or the whole device) cannot take the job (None when it can): the lanes' admission rule
    over the jobs placed there (less those on their way out) and the jobs on their way in. On a whole device the
    job's context C (enforcer.lanes) is inside what it holds: its measured C, else the settings' default on an NVML
    GPU."""
    workflow_id = wf.id
    leaving = set(session.scalars(select(Action.workflow_id).where(
        Action.from_device_id == target.id, Action.state.not_in(MOVE_OVER), Action.workflow_id != workflow_id)))
    placed = [p for p in session.scalars(select(Placement).where(
        Placement.device_id == target.id, Placement.state.in_(PLACED)))
        if p.workflow_id != workflow_id and p.workflow_id not in leaving]
    here = {p.workflow_id for p in placed}
    arriving = [a for a in _arriving(session, workflow_id, target.id) if a[0] not in here]
    if to_lane_id is not None:
        lane = session.get(Lane, to_lane_id)
        if lane is None or lane.state != "open":
            return f"target lane {to_lane_id} is closed"
        if lane.size_bytes < p_prime + ephemeral:
            return (f"target lane {lane.id} holds {lane.size_bytes} bytes, less than {workflow_id}'s own share: "
                    f"{p_prime} bytes of persistent memory plus {ephemeral} ephemeral")
        others = [(charged(int(p.mem_persistent or 0)), int(p.mem_ephemeral or 0)) for p in placed
                  if p.lane_id == lane.id]
        others += [(pp, e) for _, lane_id, pp, e in arriving if lane_id == lane.id]
        held = sum(pp for pp, _ in others)
        peak = max((e for _, e in others), default=0)
        if not lane_fits(lane.size_bytes, held, peak, p_prime, ephemeral):
            return (f"target lane {lane.id} is full: it holds {held + peak} of {lane.size_bytes} bytes for "
                    f"{len(others)} jobs, and {workflow_id} needs {p_prime} + {ephemeral}")
        return None
    taken = sorted(here | {wf_id for wf_id, _, _, _ in arriving})
    if taken:
        return f"target device {target.id} is taken by {', '.join(taken)}"
    measured = known_context(wf)
    c = measured if measured is not None else settings.context_bytes if target.source == "nvml" else 0
    if target.memory_total and not whole_device_fits(int(target.memory_total), p_prime, ephemeral, c):
        return (f"target device {target.id} has {target.memory_total} bytes, {workflow_id} needs "
                f"{p_prime + ephemeral + c} (its context {c} included)")
    return None


def _arriving(session: Session, workflow_id: str, device_id: int) -> list[tuple[str, int | None, int, int]]:
    """(workflow, lane id, P', E) of every other move under way into the device, as it was planned."""
    out = []
    for action in session.scalars(select(Action).where(
            Action.to_device_id == device_id, Action.state.not_in(MOVE_OVER), Action.workflow_id != workflow_id)):
        planned = session.scalar(select(ActionEvent).where(ActionEvent.action_id == action.id,
                                                           ActionEvent.to_state == "planned").order_by(ActionEvent.id))
        detail = dict(planned.detail or {}) if planned is not None else {}
        out.append((action.workflow_id, action.to_lane_id, int(detail.get("p_prime") or 0),
                    int(detail.get("ephemeral") or 0)))
    return out
