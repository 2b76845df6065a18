"""One enforcement cycle, the entry point the Airflow DAG and `fleetlens serve` both call: plan under the configured
policy, apply only when enforcement is switched on, record the plan's outcome, and drive unfinished actions."""

from __future__ import annotations

import logging
import time
from typing import Any

from enforcer.actuators.drive import drive_actions
from enforcer.consolidation_store import consolidation_due, make_consolidation_plan
from enforcer.plan_store import apply_plan, make_plan
from enforcer.slurm_cycle import run_slurm_cycle
from store.db import Store
from store.errors import FleetlensError
from store.models import Plan
from store.settings import Settings

log = logging.getLogger(__name__)


def run_cycle(
    store: Store,
    settings: Settings,
    *,
    enforce: bool | None = None,
    policy: str | None = None,
    now: float | None = None,
) -> dict[str, Any]:
    """Plan one cycle; apply it if `settings.enforce` or `enforce` (the Airflow Variable, say) switches it on.

    The plan is recorded in `plans` either way, with `summary["outcome"]` saying what became of it: a dry run,
    applied (its actions), nothing to apply, or why applying failed (then the error is raised after recording).
    Then every unfinished action (of this plan, or of an earlier one an operator applied) is driven forward for
    up to `settings.enforce_drive_s` (0: one step each); what is left is picked up by the next cycle, since the
    migration state machine resumes from what the store says.
    """
    now = time.time() if now is None else now
    apply = bool(settings.enforce or enforce)
    result = make_plan(store, policy or settings.policy, apply=False, settings=settings, now=now)
    outcome: dict[str, Any] = {"mode": "enforce" if apply else "dry_run", "applied": False, "actions": []}
    try:
        if apply and result.moves:
            actions = apply_plan(store, result.plan_id, settings=settings, now=now)
            outcome.update(applied=True, actions=[a.id for a in actions])
        elif apply:
            outcome["note"] = "nothing to apply"
    except FleetlensError as exc:
        outcome["error"] = str(exc)
        raise
    finally:
        _record_outcome(store, result.plan_id, outcome)
    consolidation = _consolidate(store, settings, apply, now)
    # Slurm jobs (FLEETLENS_SLURM) are planned and begun here; the driver below carries them on through the Slurm
    # actuator, never through the agents' migration
    slurm = run_slurm_cycle(store, settings, apply=apply, now=now) if settings.slurm else None
    driven = _drive(store, settings)
    return {"plan_id": result.plan_id, "policy": result.policy, **result.summary(), "outcome": outcome,
            "consolidation": consolidation, "driven": driven, "slurm": slurm}


def _consolidate(store: Store, settings: Settings, apply: bool, now: float) -> dict[str, Any] | None:
    """Every `consolidate_interval_s`: re-pack by observed demand (enforcer.consolidate); applied like a plan."""
    if not consolidation_due(store, settings, now):
        return None
    plan_id, plan = make_consolidation_plan(store, settings, now=now)
    outcome: dict[str, Any] = {"mode": "enforce" if apply else "dry_run", "applied": False, "actions": []}
    try:
        if apply and plan.moves:
            actions = apply_plan(store, plan_id, settings=settings, now=now)
            outcome.update(applied=True, actions=[a.id for a in actions])
    except FleetlensError as exc:
        outcome["error"] = str(exc)
        raise
    finally:
        _record_outcome(store, plan_id, outcome)
    return {"plan_id": plan_id, **plan.summary(), "outcome": outcome}


def _record_outcome(store: Store, plan_id: int | None, outcome: dict[str, Any]) -> None:
    with store.session() as session:
        plan = session.get(Plan, plan_id)
        if plan is not None:
            plan.summary = {**(plan.summary or {}), "outcome": outcome}  # a new dict: the JSON column sees it


def _drive(store: Store, settings: Settings) -> dict[str, str]:
    """Carry the unfinished actions forward, each through its engine's actuator; {action id: state after} (string
    keys: the summary is JSON)."""
    states = drive_actions(store, settings, timeout_s=settings.enforce_drive_s)
    return {str(action_id): state for action_id, state in states.items()}
