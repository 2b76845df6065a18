"""Carry moves forward, each through the actuator of its engine (`actions.engine`): the one loop that drives moves,
for the enforcement cycle, `fleetlens move`/`drive`, the demo and the benchmarks alike.

Which moves: the ones named, else a plan's unfinished ones, else every unfinished one. One step of each
(`timeout_s` 0) or until each is resumed, rolled back or failed (or the time is up). An action that cannot be driven
(its error is logged) does not hold up the others; an unreachable database is ridden out while there is time, and
raised when there is none (one step each)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from sqlalchemy import select

from enforcer.actuators.base import Actuator
from enforcer.actuators.registry import actuator_for
from enforcer.migration import TERMINAL, MigrationOptions
from store.db import Store
from store.errors import DatabaseUnavailable, FleetlensError, NotFound
from store.models import Action, Plan
from store.settings import Settings

log = logging.getLogger(__name__)


def drive_actions(store: Store, settings: Settings, *, action_ids: Iterable[int] | None = None,
                  plan_id: int | None = None, migration_options: MigrationOptions | None = None,
                  timeout_s: float = 0.0, poll_s: float = 0.2) -> dict[int, str]:
    """{action id: its state after} for the moves chosen (see the module), of any engine. `migration_options` go to
    the agents' actuator (its timeouts; default: from the settings). A named action not in the store raises
    NotFound."""
    ids = None if action_ids is None else list(action_ids)
    deadline = time.monotonic() + timeout_s
    actuators: dict[str, Actuator] = {}
    states: dict[int, str] = {}
    todo: dict[int, str] | None = None
    while True:
        try:
            if todo is None:
                todo = _chosen(store, ids, plan_id)
            for action_id, engine in todo.items():
                if states.get(action_id) in TERMINAL:
                    continue
                try:
                    actuator = actuators.get(engine) or actuators.setdefault(
                        engine, actuator_for(engine, store, settings, migration_options=migration_options))
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


def _chosen(store: Store, ids: list[int] | None, plan_id: int | None) -> dict[int, str]:
    """{action id: engine} of the moves to drive, in id order."""
    with store.session() as session:
        query = select(Action.id, Action.engine).order_by(Action.id)
        if ids is not None:
            found = dict(session.execute(query.where(Action.id.in_(ids))).all())
            missing = sorted(set(ids) - set(found))
            if missing:
                raise NotFound(f"no action {', '.join(map(str, missing))} in the store")
            return found
        if plan_id is not None and session.get(Plan, plan_id) is None:
            raise NotFound(f"no plan {plan_id} in the store; `fleetlens enforce` prints the id of each plan it makes")
        query = query.where(Action.state.not_in(TERMINAL))
        if plan_id is not None:
            query = query.where(Action.plan_id == plan_id)
        return dict(session.execute(query).all())


def _states(store: Store, ids: list[int]) -> dict[int, str]:
    with store.session() as session:
        return dict(session.execute(select(Action.id, Action.state).where(Action.id.in_(ids))).all())
