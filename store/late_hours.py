"""Hours that samples reached after they closed, marked at ingest so that the next rollup rolls them up again.

A rollup rolls up each closed hour once (analyzer.rollups). Samples can reach an hour after that: an agent cut off
from the database spools its samples and sends them when it comes back, an import writes the past. Every sample
write (store.ingest) therefore marks, in the same transaction, each closed hour it wrote into: one row per hour in
`late_sample_hours`, its `version` raised by every such write. The rollup reads the marks before it reads any
sample, rolls their hours up again, and then deletes each mark only if its version is still the one it read
(`clear`): a write that came meanwhile, committed or not yet, keeps its mark for the next rollup, so no late sample
is left out and none of the work depends on clocks agreeing beyond MARGIN_S. The retention deletes the marks of
hours it has taken the samples of (`drop_before`).

An hour counts as closed MARGIN_S before it ends by the writer's clock, in case the writer's clock trails the
rollup's: a write in an hour's last minute marks it too (the mark is cleared by the rollup that rolls the hour).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping

import pyarrow as pa
import pyarrow.compute as pc
from sqlalchemy import bindparam, delete, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

from store.db import Store
from store.models import LateSampleHour

HOUR = 3600.0
MARGIN_S = 60.0


def closed_before(now: float | None = None) -> float:
    """Samples before this time belong to hours that are closed (or close within MARGIN_S): their writes mark them."""
    return math.floor(((time.time() if now is None else now) + MARGIN_S) / HOUR) * HOUR


def batch_hours(batch: pa.RecordBatch | None, before: float) -> set[float]:
    """The hours of a record batch's rows (its `ts` column) that are before `before`."""
    if batch is None or not batch.num_rows or "ts" not in batch.schema.names:
        return set()
    ts = pc.cast(batch.column("ts"), pa.float64(), safe=False)
    old = pc.filter(ts, pc.less(ts, before))
    return {math.floor(t / HOUR) * HOUR for t in pc.unique(old).to_pylist() if t is not None}


def mark(conn: Connection, is_postgres: bool, hours: Iterable[float]) -> None:
    """Mark these hours in the caller's transaction (after its samples), in hour order: writers that mark the same
    hours at once take their row locks in one order."""
    hours = sorted(set(hours))
    if not hours:
        return
    insert = pg_insert if is_postgres else sqlite_insert
    stmt = insert(LateSampleHour).values([{"hour": h, "version": 1} for h in hours])
    conn.execute(stmt.on_conflict_do_update(index_elements=["hour"],
                                            set_={"version": LateSampleHour.version + 1}))


def marks(store: Store, before: float) -> dict[float, int]:
    """{hour: version} of the marked hours before `before`."""
    with store.session() as session:
        rows = session.execute(select(LateSampleHour.hour, LateSampleHour.version)
                               .where(LateSampleHour.hour < before).order_by(LateSampleHour.hour))
        return {float(h): int(v) for h, v in rows}


def clear(store: Store, seen: Mapping[float, int]) -> int:
    """Delete the marks of `seen` whose version is still the one seen (a write since keeps its mark); returns how
    many were deleted."""
    if not seen:
        return 0
    stmt = delete(LateSampleHour).where(LateSampleHour.hour == bindparam("h"),
                                        LateSampleHour.version == bindparam("v"))
    with store.engine.begin() as conn:
        result = conn.execute(stmt, [{"h": h, "v": v} for h, v in sorted(seen.items())])
    return max(result.rowcount, 0)


def drop_before(session: Session, cutoff: float) -> int:
    """Delete the marks of hours before `cutoff` (their samples are the retention's to delete, not to roll up)."""
    return session.execute(delete(LateSampleHour).where(LateSampleHour.hour < cutoff)).rowcount or 0
