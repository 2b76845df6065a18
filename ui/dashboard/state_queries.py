"""The dashboard's reading of the enforcer's fleet state: each device's free capacity by the one rule, and the
memory on it that fleetlens does not manage, as the planner and admission see them."""

from __future__ import annotations

import time

import pandas as pd

from enforcer.fleet_state import read_fleet_state
from store.db import Store

CAPACITY_COLUMNS = ["device_id", "host", "device", "memory_total", "unmanaged", "free_capacity", "jobs"]


def device_capacity(store: Store, *, now: float | None = None) -> pd.DataFrame:
    """One row per usable device: its memory, what no placement explains, its free capacity (enforcer.fleet_state's
    rule, the number admission and the planner use), and how many placed jobs it holds."""
    with store.session() as session:
        state = read_fleet_state(session, now=time.time() if now is None else now)
    rows = [(d.device_id, d.host, d.kind, d.memory_total, d.unmanaged, state.free_capacity(d.device_id),
             len(state.placements_on(d.device_id))) for d in state.devices.values()]
    return pd.DataFrame(rows, columns=CAPACITY_COLUMNS)
