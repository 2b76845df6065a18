"""Rolled-up hours that more raw samples have reached since (an agent's spool sent when the database came back, an
import of the past), found by counting each hour's rows in the database, not by reading them.

A rollup's `samples` is the number of raw rows it was made from: per device, the device samples of the hour; per
workflow, the process-sample rows of the hour (analyzer.rollups). An hour is stale when its raw rows outnumber what
its rollups counted, device samples against the device rollups or process samples against the workflow rollups.
Fewer rows than counted is not staleness: it is what retention leaves of an hour it has deleted subjects of, and
rolling such an hour again would rewrite its rollups from what is left.

The counts are one grouped COUNT per sample table over the range (on PostgreSQL the range's day partitions only:
device samples through their `ts` index, process samples by a scan of those days) and one over the rollups' `hour`
index; the answer is one row per hour.
"""

from __future__ import annotations

from sqlalchemy import Integer, cast, func, select

from store.db import Store
from store.models import DeviceSample, ProcessSample, Rollup

HOUR = 3600.0


def hour_expr(store: Store, column):
    """The SQL start of the hour of an epoch-seconds column (floor; SQLite has no floor() everywhere)."""
    if store.is_postgres:
        return func.floor(column / HOUR) * HOUR
    return cast(column / HOUR, Integer) * HOUR  # timestamps are positive, so truncation is floor


def raw_counts(store: Store, model, start: float, end: float) -> dict[float, int]:
    """{hour: rows of `model` (DeviceSample or ProcessSample)} over [start, end)."""
    hour = hour_expr(store, model.ts).label("hour")
    with store.session() as session:
        rows = session.execute(select(hour, func.count()).where(model.ts >= start, model.ts < end).group_by(hour))
        return {float(h): int(n) for h, n in rows}


def rolled_counts(store: Store, start: float, end: float) -> dict[tuple[str, float], int]:
    """{(scope, hour): raw rows its rollups counted} over the hours in [start, end)."""
    with store.session() as session:
        rows = session.execute(
            select(Rollup.scope, Rollup.hour, func.sum(Rollup.samples))
            .where(Rollup.hour >= start, Rollup.hour < end).group_by(Rollup.scope, Rollup.hour))
        return {(str(scope), float(h)): int(n) for scope, h, n in rows}


def stale_hours(store: Store, start: float, end: float) -> list[float]:
    """The hours in [start, end) (whole hours) whose raw samples outnumber what their rollups counted, in order; an
    hour with samples and no rollup at all among them."""
    if end <= start:
        return []
    # the rollups first: rows written meanwhile can only add an hour to re-roll, never hide one
    rolled = rolled_counts(store, start, end)
    stale = {h for scope, model in (("device", DeviceSample), ("workflow", ProcessSample))
             for h, n in raw_counts(store, model, start, end).items() if n > rolled.get((scope, h), 0)}
    return sorted(stale)


def hour_runs(hours: list[float]) -> list[tuple[float, float]]:
    """Contiguous [start, end) runs of these hour starts (sorted)."""
    runs: list[tuple[float, float]] = []
    for h in hours:
        if runs and runs[-1][1] == h:
            runs[-1] = (runs[-1][0], h + HOUR)
        else:
            runs.append((h, h + HOUR))
    return runs
