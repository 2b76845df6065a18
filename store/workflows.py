"""Shared queries on workflows: register or update one, and find one or say it is unknown."""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import case, select
from sqlalchemy.orm import Session

from store.errors import NotFound
from store.models import Team, Workflow
from store.rows import insert_missing
from store.signing import sign_spec, spec_digest, verify_spec


def get_workflow(session: Session, workflow_id: str) -> Workflow:
    workflow = session.get(Workflow, workflow_id)
    if workflow is None:
        raise NotFound(f"no workflow {workflow_id!r} in the store; `fleetlens status` lists what is recorded")
    return workflow


def upsert_workflow(session: Session, workflow_id: str, *, now: float | None = None, **fields: Any) -> Workflow:
    """Create the workflow if it is new, set the given fields, and mark it seen now."""
    now = time.time() if now is None else now
    workflow = session.get(Workflow, workflow_id)
    if workflow is None:
        # agents on several hosts register one job's workflow at once: the first insert wins, none fails
        insert_missing(session, Workflow, {"id": workflow_id, "created_at": now, "last_seen": now, "labels": {}})
        workflow = session.get(Workflow, workflow_id)
    for key, value in fields.items():
        if not hasattr(Workflow, key):
            raise AttributeError(f"workflows have no column {key!r}")
        setattr(workflow, key, value)
    # in SQL, against the row as committed when it is written: another host's agent may have marked it seen later
    # since this session read it, and last_seen never goes back
    workflow.last_seen = case((Workflow.last_seen < now, now), else_=Workflow.last_seen)
    session.flush()
    return workflow


def is_movable(session: Session, workflow: Workflow) -> bool:
    """Only managed jobs are moved, and only when their owner opted in (per workflow or per team)."""
    if not workflow.managed:
        return False
    if workflow.movable:
        return True
    if workflow.team:
        team = session.scalar(select(Team).where(Team.name == workflow.team))
        return bool(team and team.movable)
    return False


def workflow_spec_digest(workflow: Workflow) -> str:
    return spec_digest(list(workflow.command or []), workflow.cwd or "", dict(workflow.spec_env or {}),
                       workflow.checkpoint_dir, workflow.checkpoint_url)


def sign_workflow_spec(workflow: Workflow, secret: bytes) -> None:
    """Fix the managed job's relaunch spec as it is now: its digest, signed under the fleet secret."""
    workflow.spec_signature = sign_spec(secret, workflow_spec_digest(workflow))


def spec_refusal(workflow: Workflow, secret: bytes) -> str | None:
    """Why the managed job's relaunch spec must not run (None when its signature matches it)."""
    if not workflow.spec_signature:
        return (f"{workflow.id} has no signed relaunch spec (registered by an older fleetlens); start it "
                "again with `fleetlens run`")
    if not verify_spec(secret, workflow.spec_signature, workflow_spec_digest(workflow)):
        return (f"the relaunch spec of {workflow.id} (command line, working folder, environment or "
                "checkpoint location) does not match the digest signed when it was registered; it was changed in "
                "the store since, or signed with another FLEETLENS_SECRET")
    return None
