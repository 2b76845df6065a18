"""Device-hours held and active over any time window: the hourly rollups where they exist, the rollup function on
raw samples for the rest, so a window's figures agree with what `rollup` writes for the same hours."""

from __future__ import annotations

import math
import time
from typing import Any

import pandas as pd
from sqlalchemy import func, select
from sqlalchemy.sql import Select

from analyzer.rollups import HOUR, device_rollups
from analyzer.telemetry.frame import load_window
from analyzer.telemetry.thresholds import load_thresholds
from store.db import Store
from store.models import Rollup


def _frame(store: Store, stmt: Select) -> pd.DataFrame:
    with store.session() as session:
        return pd.read_sql(stmt, session.connection())


def rolled_device_hours(store: Store, start: float, end: float) -> dict[str, float]:
    """Sum of the device rollups whose hour starts in [start, end): held, active and the devices seen."""
    stmt = select(
        func.coalesce(func.sum(Rollup.gpu_hours_held), 0.0).label("held"),
        func.coalesce(func.sum(Rollup.gpu_hours_active), 0.0).label("active"),
        func.count(func.distinct(Rollup.subject)).label("devices"),
    ).where(Rollup.scope == "device", Rollup.hour >= start, Rollup.hour < end)
    row = _frame(store, stmt).iloc[0]
    return {"held": float(row.held), "active": float(row.active), "devices": int(row.devices)}


def device_hours(store: Store, start: float, end: float) -> dict[str, float]:
    """Device-hours held (a job holds the device) and active (held x utilisation) in [start, end).

    Sums the rollups of the whole hours inside the window that are already rolled up, and runs the rollup
    function over the raw samples of the rest (the partial hour at the start, and the hours not rolled up yet).
    """
    first_full = math.ceil(start / HOUR) * HOUR
    rolled = _frame(store, (
        select(Rollup.hour, func.sum(Rollup.gpu_hours_held).label("held"),
               func.sum(Rollup.gpu_hours_active).label("active"),
               func.count(func.distinct(Rollup.subject)).label("devices"))
        .where(Rollup.scope == "device", Rollup.hour >= first_full, Rollup.hour + HOUR <= end)
        .group_by(Rollup.hour)
    )).set_index("hour")
    rolled_end = first_full
    while rolled_end in rolled.index:  # only a contiguous run from the start, so no hour is counted twice
        rolled_end += HOUR
    used = rolled.loc[rolled.index < rolled_end]
    held, active = float(used.held.sum()), float(used.active.sum())
    segments = [(start, first_full), (rolled_end, end)] if rolled_end > first_full else [(start, end)]
    devices = set()
    for seg_start, seg_end in segments:
        if seg_end <= seg_start:
            continue
        for row in _raw_device_rollups(store, seg_start, seg_end):
            held += row["gpu_hours_held"]
            active += row["gpu_hours_active"]
            devices.add(row["subject"])
    n_devices = max(len(devices), int(used.devices.max()) if not used.empty else 0)
    return {"held": held, "active": active, "devices": n_devices}


def _raw_device_rollups(store: Store, start: float, end: float) -> list[dict[str, Any]]:
    thresholds = load_thresholds()
    return device_rollups(load_window(store, start, end, thresholds.common), time.time())
