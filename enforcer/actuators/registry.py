"""Which actuator carries the moves of which engine (`actions.engine`): one entry per engine, written here.

A new engine is one module in enforcer/actuators/ with a class that satisfies `base.Actuator`, and one line in
`ACTUATORS` (docs/architecture.md, "Adding an actuator"). Nothing registers itself on import.
"""

from __future__ import annotations

from collections.abc import Callable

from enforcer.actuators.agents import AgentsActuator
from enforcer.actuators.base import Actuator
from enforcer.actuators.slurm import SlurmActuator
from store.db import Store
from store.errors import InvalidInput
from store.settings import Settings

ACTUATORS: dict[str, Callable[[Store, Settings], Actuator]] = {
    AgentsActuator.engine: AgentsActuator,
    SlurmActuator.engine: SlurmActuator,
}


def actuator_for(engine: str, store: Store, settings: Settings) -> Actuator:
    """The actuator of `engine`; an engine no actuator carries raises InvalidInput naming the ones there are."""
    factory = ACTUATORS.get(engine)
    if factory is None:
        raise InvalidInput(f"no actuator carries moves of engine {engine!r}; the engines are {sorted(ACTUATORS)}")
    return factory(store, settings)
