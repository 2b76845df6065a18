"""Carry every unfinished move forward, each through the actuator of its engine (`actions.engine`).

One step of each (`timeout_s` 0) or until each is resumed, rolled back or failed (or the time is up). An action that
cannot be driven (its error is logged) does not hold up the others; an unreachable database is ridden out while
there is time, and raised when there is none (one step each)."""

from __future__ import annotations

import logging
import time

from sqlalchemy import select

from enforcer.actuators.base import Actuator
from enforcer.actuators.registry import actuator_for
from enforcer.migration import TERMINAL
from store.db import Store
from store.errors import DatabaseUnavailable, FleetlensError
from store.models import Action
from store.settings import Settings

log = logging.getLogger(__name__)


def drive_actions(store: Store, settings: Settings, *, timeout_s: float = 0.0, poll_s: float = 0.2
                  ) -> dict[int, str]:
    """{action id: its state after} for every action unfinished now, of any engine."""
    deadline = time.monotonic() + timeout_s
    actuators: dict[str, Actuator] = {}
    states: dict[int, str] = {}
    todo: dict[int, str] | None = None
    while True:
        try:
            if todo is None:
                todo = _unfinished(store)
            for action_id, engine in todo.items():
                if states.get(action_id) in TERMINAL:
                    continue
                try:
                    actuator = actuators.get(engine) or actuators.setdefault(
                        engine, actuator_for(engine, store, settings))
                    actuator.advance(action_id, now=time.time())
                except DatabaseUnavailable:
                    raise
                except FleetlensError as exc:
                    log.error("action %s cannot be driven: %s", action_id, exc)
            states.update(_states(store, list(todo)))
        except DatabaseUnavailable as exc:
            if timeout_s <= 0:
                raise
            log.warning("database unavailable while driving moves (will retry): %s", exc)
        if todo is not None and all(states.get(a) in TERMINAL for a in todo):
            return states
        if time.monotonic() > deadline:
            return states
        time.sleep(poll_s)


def _unfinished(store: Store) -> dict[int, str]:
    with store.session() as session:
        return dict(session.execute(select(Action.id, Action.engine).where(Action.state.not_in(TERMINAL))
                                    .order_by(Action.id)).all())


def _states(store: Store, ids: list[int]) -> dict[int, str]:
    with store.session() as session:
        return dict(session.execute(select(Action.id, Action.state).where(Action.id.in_(ids))).all())
