"""The dashboard's reading of the enforcer's fleet state: each device's free capacity by the one rule, and the
memory on it that fleetlens does not manage, as the planner and admission see them."""

from __future__ import annotations

import time

import pandas as pd

from enforcer.fleet_state import read_fleet_state
from store.db import Store
from store.settings import Settings, get_settings

CAPACITY_COLUMNS = ["device_id", "host", "device", "memory_total", "unmanaged", "free_capacity", "jobs"]


def device_capacity(store: Store, *, now: float | None = None, settings: Settings | None = None) -> pd.DataFrame:
    """One row per usable device: its memory, what no placement explains, its free capacity (enforcer.fleet_state's
    rule, the number admission and the planner use, with the same settings: they say the context charge), and how
    many placed jobs it holds."""
    with store.session() as session:
        state = read_fleet_state(session, now=time.time() if now is None else now,
                                 settings=settings or get_settings())
    rows = [(d.device_id, d.host, d.kind, d.memory_total, d.unmanaged, state.free_capacity(d.device_id),
             len(state.placements_on(d.device_id))) for d in state.devices.values()]
    return pd.DataFrame(rows, columns=CAPACITY_COLUMNS)


def workflow_placement(store: Store, workflow_id: str, *, now: float | None = None) -> list[dict[str, object]]:
    """Where the workflow is placed now, from the fleet state: per device, its lane (None: the whole device), the
    other jobs placed there (lane-mates first), and the device's free capacity by the one rule."""
    with store.session() as session:
        state = read_fleet_state(session, now=time.time() if now is None else now, settings=get_settings())
    out: list[dict[str, object]] = []
    for p in state.placements:
        if p.workflow_id != workflow_id:
            continue
        others = [q for q in state.placements_on(p.device_id) if q.workflow_id != workflow_id]
        mates = sorted(q.workflow_id for q in others if p.lane_id is not None and q.lane_id == p.lane_id)
        beside = sorted(q.workflow_id for q in others if q.workflow_id not in mates)
        out.append({"device_id": p.device_id, "host": p.host, "lane_id": p.lane_id, "state": p.state,
                    "lane_mates": mates, "beside": beside, "free_capacity": state.free_capacity(p.device_id)})
    return out
