"""The record of a Slurm move in the store: its action row (engine 'slurm') and the events of its steps.

A step is written only if the action is still in the state the step was decided in (`_stepping`): when two enforcers
(serve's cycle and a DAG, say) step one move at once, the first one's record stands and the second's is dropped.
"""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy import select

from enforcer.actuators.base import Step, StepOutcome
from store.db import Store
from store.models import Action, ActionEvent

log = logging.getLogger("enforcer.actuators.slurm")  # the actuator's log: these records are its steps


class SlurmActionRecord:
    """The store side of enforcer.actuators.slurm.SlurmActuator, which it is mixed into: reads and writes the
    actuator's actions. `_stepping` is the (action, state) the step under way was decided in (None: no step under
    way, every write stands)."""

    store: Store
    _stepping: tuple[int, str] | None

    def _created(self, action_id: int) -> float:
        with self.store.session() as session:
            return float(session.get(Action, action_id).created_at)

    def _workflow(self, action_id: int) -> str:
        with self.store.session() as session:
            return session.get(Action, action_id).workflow_id

    def _note(self, action_id: int, detail: dict[str, Any]) -> bool:
        """Record `detail` without a step (what is about to be sent), if the action is still in the state this step
        was decided in; False when another enforcer moved it on meanwhile."""
        with self.store.session() as session:
            query = select(Action).where(Action.id == action_id)
            action = session.scalar(query.with_for_update() if self.store.is_postgres else query)
            if self._stepping is not None and self._stepping != (action_id, action.state):
                return False
            action.detail = detail
            return True

    def _to(self, action_id: int, state: str, detail: dict[str, Any], now: float, step: Step | None, ok: bool,
            message: str, training_step: int | None = None) -> list[StepOutcome]:
        with self.store.session() as session:
            query = select(Action).where(Action.id == action_id)
            action = session.scalar(query.with_for_update() if self.store.is_postgres else query)
            before = action.state
            if self._stepping is not None and self._stepping != (action_id, before):
                # another enforcer took this step meanwhile (serve and a DAG, say): its record stands
                log.info("Slurm action %s moved on to %s meanwhile; this step is not recorded", action_id, before)
                return []
            action.state, action.detail, action.updated_at = state, detail, now
            if not ok:
                action.error = message
            session.add(ActionEvent(action_id=action_id, ts=now, from_state=before, to_state=state, message=message,
                                    detail={k: v for k, v in detail.items() if k != "reason"}))
        return [] if step is None else [StepOutcome(action_id, step, ok, now, message, training_step)]

    def _end(self, action_id: int, state: str, step: Step, now: float, ok: bool, message: str,
             training_step: int | None = None, extra: dict[str, Any] | None = None) -> list[StepOutcome]:
        with self.store.session() as session:
            detail = {**dict(session.get(Action, action_id).detail or {}), **(extra or {}),
                      "outcome": message}
        return self._to(action_id, state, detail, now, step, ok, message, training_step)
