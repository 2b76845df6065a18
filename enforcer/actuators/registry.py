"""Which actuator carries the moves of which engine (`actions.engine`): one entry per engine, written here.

A new engine is one module in enforcer/actuators/ with a class that satisfies `base.Actuator`, and one line in
`ACTUATORS` (docs/architecture.md, "Adding an actuator"). Nothing registers itself on import.
"""

from __future__ import annotations

from collections.abc import Callable

from enforcer.actuators.agents import AgentsActuator
from enforcer.actuators.base import Actuator
from enforcer.actuators.slurm import SlurmActuator
from enforcer.migration import MigrationOptions
from store.db import Store
from store.errors import InvalidInput
from store.settings import Settings

ACTUATORS: dict[str, Callable[[Store, Settings], Actuator]] = {
    AgentsActuator.engine: AgentsActuator,
    SlurmActuator.engine: SlurmActuator,
}


def actuator_for(engine: str, store: Store, settings: Settings, *,
                 migration_options: MigrationOptions | None = None) -> Actuator:
    """The actuator of `engine`; an engine no actuator carries raises InvalidInput naming the ones there are.
    `migration_options` (the agents' state machine's timeouts) go to the agents' actuator only."""
    factory = ACTUATORS.get(engine)
    if factory is None:
        raise InvalidInput(f"no actuator carries moves of engine {engine!r}; the engines are {sorted(ACTUATORS)}")
    if engine == AgentsActuator.engine and migration_options is not None:
        return AgentsActuator(store, settings, migration_options)
    return factory(store, settings)
