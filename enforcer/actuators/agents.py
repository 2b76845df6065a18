"""The agents' actuator: moves of `fleetlens run` jobs carried out by signed commands to the hosts' agents
(checkpoint, stop, relaunch), through the migration state machine (enforcer.migration), unchanged.

`begin` records the move (`start_migration`: the 'planned' action, after the plan-level checks `plan_action` runs
once); `advance` takes one step of the state machine and reports what it came to, read back from the action's event
log. Its own verification runs inside: the relaunch spec must match its signature (here and on the agent), the
checkpoint young enough when the stop reaches the job, its size and sha256 (the agent, before it starts the job) and
a resume step at or above the checkpoint's (`migration`'s 'relaunched' step).
"""

from __future__ import annotations

from typing import Any, ClassVar

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from enforcer.actuators.base import Move, Step, StepOutcome
from enforcer.migration import MigrationOptions, drive, start_migration
from store.db import Store
from store.models import ActionEvent
from store.settings import Settings

# the state machine's states that are steps of the seam (the others: waiting on a command, or rolling back)
STEP_OF_STATE: dict[str, Step] = {
    "planned": Step.PLANNED,
    "checkpointed": Step.CHECKPOINTED,
    "stopped": Step.STOPPED,
    "relaunched": Step.PLACED,
    "resumed": Step.RESUMED,
    "rolled_back": Step.ROLLED_BACK,
    "failed": Step.FAILED,
}
OK_STEPS = frozenset({Step.PLANNED, Step.CHECKPOINTED, Step.STOPPED, Step.PLACED, Step.RESUMED})


class AgentsActuator:
    """Signed commands to the agents of the job's hosts; one instance per enforcer run (it holds no state)."""

    engine: ClassVar[str] = "agents"

    def __init__(self, store: Store, settings: Settings, options: MigrationOptions | None = None) -> None:
        self.store, self.settings = store, settings
        self.options = options or MigrationOptions.from_settings(settings)

    def begin(self, move: Move, *, now: float) -> int:
        return start_migration(
            self.store, move.workflow_id, move.to_device_id, to_lane_id=move.to_lane_id,
            new_lane_size=move.new_lane_size, compute_share=move.compute_share, policy=move.policy,
            settings=self.settings, now=now, plan_id=move.plan_id, expected_slowdown=move.expected_slowdown,
            engine=self.engine)

    def advance(self, action_id: int, *, now: float) -> list[StepOutcome]:
        with self.store.session() as session:
            seen = session.scalar(select(func.max(ActionEvent.id)).where(ActionEvent.action_id == action_id)) or 0
        drive(self.store, action_id, settings=self.settings, options=self.options, now=now)
        with self.store.session() as session:
            return step_outcomes(session, action_id, after_event=seen)


def step_outcomes(session: Session, action_id: int, *, after_event: int = 0) -> list[StepOutcome]:
    """The steps an action of the agents' state machine came to, oldest first (after event `after_event`)."""
    out = []
    for e in session.scalars(select(ActionEvent).where(ActionEvent.action_id == action_id,
                                                       ActionEvent.id > after_event).order_by(ActionEvent.id)):
        step = STEP_OF_STATE.get(e.to_state)
        if step is None or e.from_state == e.to_state:
            continue  # a wait, a roll-back under way, or a note (a command sent again)
        out.append(StepOutcome(action_id, step, step in OK_STEPS, float(e.ts), e.message or "",
                               _training_step(step, dict(e.detail or {}))))
    return out


def _training_step(step: Step, detail: dict[str, Any]) -> int | None:
    value = detail.get("step") if step is Step.CHECKPOINTED else (
        detail.get("first_step") if step is Step.RESUMED else None)
    return None if value is None else int(value)
