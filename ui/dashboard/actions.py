"""The dashboard's state-changing actions; each checks the caller's role on the server before it writes.

They call the packages that own the behaviour (store.profiling, store.findings, enforcer.plan_store) and never
write those tables themselves.
"""

from __future__ import annotations

from typing import Any

from enforcer import plan_store
from store import profiling
from store.db import Store
from store.errors import InvalidInput
from store.findings import set_finding_status as _set_finding_status
from store.settings import Settings
from ui.dashboard.auth import Principal, require_operator

MAX_PROFILE_STEPS = 1000


def request_profile(store: Store, principal: Principal | None, workflow_id: str, steps: int) -> int:
    """Ask the workflow's agent to capture a trace of `steps` steps; returns the profile request's id."""
    require_operator(principal, "trigger a profile")
    if not isinstance(steps, int) or not 1 <= steps <= MAX_PROFILE_STEPS:
        raise InvalidInput(f"steps must be a whole number from 1 to {MAX_PROFILE_STEPS}; got {steps!r}")
    with store.session() as session:
        request = profiling.request_profile(
            session, workflow_id, steps, reason="on_demand", requested_by=principal.name
        )
        session.flush()
        return int(request.id)


def set_finding_status(store: Store, principal: Principal | None, finding_id: int, status: str) -> None:
    """Acknowledge or resolve (or reopen) a finding, recording who did it."""
    verb = {"acknowledged": "acknowledge", "resolved": "resolve", "open": "reopen"}.get(status, "change")
    require_operator(principal, f"{verb} findings")
    with store.session() as session:
        _set_finding_status(session, int(finding_id), status, by=principal.name)


def apply_plan(store: Store, principal: Principal | None, plan: Any, *, settings: Settings, confirmed: bool) -> Any:
    """Apply an enforcement plan (start its migrations); refused without the operator role and a confirmation."""
    require_operator(principal, "apply enforcement plans")
    if not confirmed:
        raise InvalidInput("tick the confirmation before applying a plan: it checkpoints and moves running jobs")
    return plan_store.apply_plan(store, plan, settings=settings)


def make_plan(store: Store, principal: Principal | None, policy: str, *, settings: Settings) -> Any:
    """Record a fresh (unapplied) plan for `policy` so it can be previewed and then applied as shown."""
    require_operator(principal, "make enforcement plans")
    return plan_store.make_plan(store, policy, apply=False, settings=settings)
