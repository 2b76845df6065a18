"""The plan-level checks of a move, defined once: may this job be moved from its host to that one now?

A plan-level check looks at the fleet's facts, not at the job's bytes: the target device is there and usable, and
the target host said lately that it can read and write the job's checkpoint location (else the job could not resume
there). The planner plans around such hosts from the same facts (`FleetState.workflows[...].readable_hosts`);
`refuse_unsafe_moves` takes out of a plan what a fresher probe now forbids; `apply_plan` and `start_migration` refuse
before anything is written; an actuator runs `plan_refusal` once more as the move starts, since facts may have
changed between applying a plan and carrying it out. What belongs to execution (the relaunch spec matches its
signature, the checkpoint's size and sha256, the resume step at or above the checkpoint's) is checked inside the
actuator (enforcer.actuators.agents and the agent it commands), never here.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from store.checkpoints import unreadable_reason
from store.models import Device, Workflow
from store.settings import Settings


def target_refusal(target: Device | None, to_device_id: int) -> str | None:
    """Why the target device cannot take anything (None when it can)."""
    if target is None or target.state != "ok":
        return f"target device {to_device_id} is gone (not in the store, or lost)"
    return None


def plan_refusal(session: Session, wf: Workflow, source_host: str | None, target_host: str, settings: Settings, *,
                 now: float) -> str | None:
    """Why moving `wf` from `source_host` to `target_host` is not safe at the plan level (None when it is): the target
    host cannot be trusted to read the job's checkpoints (probes older than `storage_probe_max_age_s` do not count)."""
    return unreadable_reason(session, wf, source_host, target_host, max_age_s=settings.storage_probe_max_age_s,
                             now=now)


def unsafe_moves(session: Session, moves: list, settings: Settings, now: float) -> tuple[set[int], list[dict]]:
    """The plan-level check over a plan's moves (each with workflow_id, from_device_id, to_device_id): the source
    devices one of whose jobs cannot go, and a refusal (with the reason) per such job."""
    hosts = {d.id: d.host_id for d in session.scalars(select(Device))}
    blocked: set[int] = set()
    refused: list[dict] = []
    for m in moves:
        wf = session.get(Workflow, m.workflow_id)
        reason = "the workflow is gone" if wf is None else plan_refusal(
            session, wf, hosts.get(m.from_device_id), hosts.get(m.to_device_id, ""), settings, now=now)
        if reason is not None:
            blocked.add(m.from_device_id)
            refused.append({"workflow_id": m.workflow_id, "from_device_id": m.from_device_id,
                            "to_device_id": m.to_device_id, "reason": reason})
    return blocked, refused
