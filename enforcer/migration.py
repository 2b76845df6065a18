"""Migration, safe by construction: the state machine that moves one managed job, persisted in actions and
action_events, carried out by signed commands the job's host runs (collector.job_start, collector.job_control).
Its steps are enforcer.migration_steps; enforcer.actuators.agents is the actuator built on it.

    planned -> checkpoint_requested -> checkpointed -> stopped -> relaunched -> resumed (done)
                       |                                 |
                       +--(job died)--> rolling_back <---+--(target full / cannot start there / died there)
                                             |
                                             +--> rolled_back (running where it was, from its checkpoint)
    any step that cannot go on without risk -> failed (with the job left as it was, or said where it is)
    a host the move waits on gone silent (enforcer.move_silence) -> failed before the stop, rolling_back after it

`drive(store, action_id)` advances one action by at most one step, from what the store says alone (the action's
state and the commands issued for it), so it is idempotent and picks up after the enforcer or an agent crashes:
a command whose outcome never arrives (agent killed, database away) is sent again after its deadline, and every
handler on the agent is idempotent. Nothing is stopped before a checkpoint is safely written; a job that cannot
checkpoint is left running where it was. Every transition writes an action_event a person can read.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from enforcer.migration_steps import (
    STEPS,
    MigrationOptions,
    StepRunner,
    active_placement,
    admitted_memory,
    transition,
)
from enforcer.move_checks import move_refusal
from store.db import Store
from store.errors import InvalidInput, NotFound
from store.headroom import charged
from store.models import Action, ActionEvent, Device, Lane, Workflow
from store.settings import Settings
from store.workflows import spec_refusal

log = logging.getLogger(__name__)

TERMINAL = ("resumed", "rolled_back", "failed")
STATES = ("planned", "checkpoint_requested", "checkpointed", "stopped", "relaunched", "resumed", "rolling_back",
          "rolled_back", "failed")
ENGINE = "agents"  # actions.engine of the moves this state machine carries out (enforcer.actuators.agents)


# ---- creating an action by hand (the planner's apply_plan makes them too) ----------------------------------

def start_migration(store: Store, workflow_id: str, to_device_id: int, *, to_lane_id: int | None = None,
                    new_lane_size: int | None = None, compute_share: float = 1.0, policy: str | None = None,
                    settings: Settings, now: float | None = None, plan_id: int | None = None,
                    expected_slowdown: float | None = None, engine: str = "agents") -> int:
    """A 'planned' migration of a running managed job to a device (whole), an existing lane, or a new lane of
    `new_lane_size` bytes; returns the action id. Raises, with nothing written, when the move makes no sense."""
    now = time.time() if now is None else now
    with store.session() as session:
        wf = session.get(Workflow, workflow_id)
        if wf is None:
            raise NotFound(f"no workflow {workflow_id!r} in the store; nothing moved")
        if not wf.managed or not wf.command:
            raise InvalidInput(f"{workflow_id!r} is not a managed job (start it with `fleetlens run`); nothing moved")
        if wf.state != "running":
            raise InvalidInput(f"{workflow_id!r} is {wf.state}, not running; nothing moved")
        here = active_placement(session, workflow_id)
        if here is None:
            raise InvalidInput(f"{workflow_id!r} has no active placement; nothing moved")
        if session.get(Device, to_device_id) is None:
            raise NotFound(f"target device {to_device_id} is not in the store; nothing moved")
        if to_lane_id is not None and session.get(Lane, to_lane_id) is None:
            raise NotFound(f"target lane {to_lane_id} is not in the store; nothing moved")
        refusal = spec_refusal(wf, settings.secret_bytes())  # the agents' own verification, before anything
        if refusal is not None:
            raise InvalidInput(f"refused: {refusal}; nothing moved, {workflow_id} runs on where it is")
        persistent, e = admitted_memory(wf, here)
        p_prime = charged(persistent)
        size = new_lane_size if new_lane_size is not None else (
            session.get(Lane, to_lane_id).size_bytes if to_lane_id is not None else None)
        if size is not None and p_prime and size < p_prime + e:
            raise InvalidInput(
                f"a lane of {size} bytes cannot hold {workflow_id!r}: it needs {p_prime} bytes of persistent memory "
                f"(with headroom) plus {e} ephemeral; give a lane of at least {p_prime + e} bytes; nothing moved")
        if new_lane_size is not None:
            lane = Lane(device_id=to_device_id, size_bytes=int(new_lane_size), compute_share=compute_share,
                        state="open", created_at=now)
            session.add(lane)
            session.flush()
            to_lane_id = lane.id
        action = plan_action(session, workflow_id, policy, here.device_id, to_device_id, to_lane_id, now=now,
                             message=f"planned by hand: device {here.device_id} -> {to_device_id}"
                                     f"{f' lane {to_lane_id}' if to_lane_id else ' (whole device)'}",
                             detail={"p_prime": p_prime, "ephemeral": e, "persistent": persistent},
                             settings=settings, plan_id=plan_id, expected_slowdown=expected_slowdown, engine=engine)
        return action.id



class MoveRefused(InvalidInput):
    """A move the plan-level checks (enforcer.move_checks) refuse; `reason` says why. Nothing was recorded."""

    def __init__(self, workflow_id: str, reason: str) -> None:
        super().__init__(f"refused: {reason}; nothing moved, {workflow_id} runs on where it is")
        self.workflow_id, self.reason = workflow_id, reason


def plan_action(session: Session, workflow_id: str, policy: str | None, from_device_id: int, to_device_id: int,
                to_lane_id: int | None, *, now: float, message: str, detail: dict[str, Any], settings: Settings,
                plan_id: int | None = None, expected_slowdown: float | None = None, engine: str = "agents") -> Action:
    """Begin a move: run its plan-level checks (enforcer.move_checks, the one place they run) and record it in state
    'planned' with its first event (`detail` holds the P' and E it was planned with, which the checks use); `engine`
    names the actuator that carries it out. A refused move raises MoveRefused and is not recorded, so no actuator
    ever receives it."""
    refusal = move_refusal(session, session.get(Workflow, workflow_id), from_device_id, to_device_id, to_lane_id,
                           int(detail.get("p_prime") or 0), int(detail.get("ephemeral") or 0), settings, now=now)
    if refusal is not None:
        raise MoveRefused(workflow_id, refusal)
    action = Action(plan_id=plan_id, kind="migrate", engine=engine, workflow_id=workflow_id, policy=policy,
                    from_device_id=from_device_id, to_device_id=to_device_id, to_lane_id=to_lane_id,
                    state="planned", expected_slowdown=expected_slowdown, attempts=0, created_at=now,
                    updated_at=now)
    session.add(action)
    session.flush()
    session.add(ActionEvent(action_id=action.id, ts=now, from_state=None, to_state="planned", message=message,
                            detail=detail))
    return action


# ---- driving -----------------------------------------------------------------------------------------------------

def drive(store: Store, action_id: int, *, settings: Settings, options: MigrationOptions | None = None,
          now: float | None = None) -> str:
    """Advance one action by at most one step; returns its state afterwards. Raises DatabaseUnavailable when
    the store cannot be reached (nothing is half-written: each step is one transaction)."""
    options = options or MigrationOptions.from_settings(settings)
    now = time.time() if now is None else now
    with store.session() as session:
        query = select(Action).where(Action.id == action_id)
        if store.is_postgres:
            query = query.with_for_update()  # two enforcers never take the same step twice
        action = session.scalar(query)
        if action is None:
            raise NotFound(f"no action {action_id} in the store")
        if action.engine != ENGINE:
            raise InvalidInput(f"action {action_id} is carried out by the {action.engine!r} actuator, not by the "
                               "agents' state machine")
        if action.state in TERMINAL:
            return action.state
        step = STEPS.get(action.state)
        if step is None:
            transition(session, action, "failed", f"unknown state {action.state!r}; nothing more is done", now)
            return action.state
        StepRunner(session, action, settings, options, now).run(step)
        return action.state


def action_log(store: Store, action_id: int) -> list[dict[str, Any]]:
    """The action's events, oldest first: ts, from_state, to_state, message, detail."""
    with store.session() as session:
        return [{"ts": e.ts, "from_state": e.from_state, "to_state": e.to_state, "message": e.message,
                 "detail": dict(e.detail or {})}
                for e in session.scalars(select(ActionEvent).where(ActionEvent.action_id == action_id)
                                         .order_by(ActionEvent.ts, ActionEvent.id))]


# ---- the steps -------------------------------------------------------------------------------------------------


def reset_workflow_state(store: Store, workflow_id: str) -> None:
    """After a failed move whose job still runs where it was: its state goes back to running."""
    with store.session() as session:
        session.execute(update(Workflow).where(Workflow.id == workflow_id, Workflow.state == "moving")
                        .values(state="running"))
