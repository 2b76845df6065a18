"""The dashboard's state-changing actions; each checks the caller's role on the server before it writes.

They call the packages that own the behaviour (store.profiling, store.findings, enforcer.planner) and never
write those tables themselves. A package that has not landed yet raises NotAvailable, which the page shows
as a message instead of pretending the action worked.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType
from typing import Any

from store.db import Store
from store.errors import FleetlensError, InvalidInput
from ui.auth import Principal, require_operator

MAX_PROFILE_STEPS = 1000


class NotAvailable(FleetlensError):
    """The package behind a control is not installed in this build yet."""


def _module(name: str, what: str) -> ModuleType:
    try:
        found = importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        raise NotAvailable(f"{what} is not available yet: this fleetlens has no {name}")
    return importlib.import_module(name)


def profiling_available() -> bool:
    return _available("store.profiling", "request_profile")


def planner_available() -> bool:
    return _available("enforcer.planner", "apply_plan")


def ranking_available() -> bool:
    return _available("analyzer.ranking", None)


def _available(name: str, attr: str | None) -> bool:
    try:
        module = _module(name, name)
    except (NotAvailable, ImportError):
        return False
    return attr is None or hasattr(module, attr)


def request_profile(store: Store, principal: Principal | None, workflow_id: str, steps: int) -> int:
    """Ask the workflow's agent to capture a trace of `steps` steps; returns the profile request's id."""
    require_operator(principal, "trigger a profile")
    if not isinstance(steps, int) or not 1 <= steps <= MAX_PROFILE_STEPS:
        raise InvalidInput(f"steps must be a whole number from 1 to {MAX_PROFILE_STEPS}; got {steps!r}")
    profiling = _module("store.profiling", "on-demand profiling")
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
    from store.findings import set_finding_status as _set

    with store.session() as session:
        _set(session, int(finding_id), status, by=principal.name)


def apply_plan(store: Store, principal: Principal | None, plan: Any, *, confirmed: bool) -> Any:
    """Apply an enforcement plan (start its migrations); refused without the operator role and a confirmation."""
    require_operator(principal, "apply enforcement plans")
    if not confirmed:
        raise InvalidInput("tick the confirmation before applying a plan: it checkpoints and moves running jobs")
    planner = _module("enforcer.planner", "applying plans")
    return planner.apply_plan(store, plan)


def make_plan(store: Store, principal: Principal | None, policy: str) -> Any:
    """Record a fresh (unapplied) plan for `policy` so it can be previewed and then applied as shown."""
    require_operator(principal, "make enforcement plans")
    planner = _module("enforcer.planner", "planning")
    return planner.make_plan(store, policy, apply=False)
