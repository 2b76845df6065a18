"""Day partitions of the sample tables on PostgreSQL: created ahead of the agents, filled from the default
partition when rows came early, dropped whole when their day has aged out.

At 10,000 devices sampled every second a day is 864 M device rows (and as many process rows). PostgreSQL
partitions `device_samples` and `process_samples` by range of `ts`, one partition per UTC day
(`device_samples_p20261123`, ...), so a query over a window only touches the days it covers, each day's indexes
stay the size of one day, and retention drops a day's table instead of deleting its rows one by one. A DEFAULT
partition (`..._default`) takes any row no day partition covers (an agent whose clock is hours or days off, a day
nobody created yet), so no write is ever refused for its time; `ensure_partitions` later moves those rows into
their day's partition, in one transaction (rows no day can hold, see has_day, stay in the default). SQLite (one
host) keeps plain tables: every function here does nothing there.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import text
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError

from store.db import Store, is_contention
from store.errors import InvalidInput

log = logging.getLogger(__name__)

DAY = 86400.0
SAMPLE_TABLES = ("device_samples", "process_samples")
_CHILD = re.compile(r"^(device_samples|process_samples)_(p\d{8}|default)$")
_BOUND = re.compile(r"FROM \('?([-0-9.e+]+)'?\) TO \('?([-0-9.e+]+)'?\)")


def is_partition(name: str) -> bool:
    """True for a partition's table name (the schema's models know only the parents)."""
    return bool(_CHILD.match(name))


# the days a partition can be made for: its name is the day's date, years 1 to 9999
_FIRST_DAY = datetime(1, 1, 1, tzinfo=UTC).timestamp()
_LAST_DAY = datetime(9999, 12, 31, tzinfo=UTC).timestamp()


def has_day(ts: float) -> bool:
    """A day partition can hold `ts`: a finite time of the years 1 to 9999 (not a clock gone wrong by orders of
    magnitude, e.g. milliseconds taken for seconds)."""
    return math.isfinite(ts) and _FIRST_DAY <= ts < _LAST_DAY + DAY


def day_of(ts: float) -> float:
    return math.floor(float(ts) / DAY) * DAY


def partition_name(table: str, day: float) -> str:
    return f"{table}_p{datetime.fromtimestamp(day, UTC):%Y%m%d}"


def default_name(table: str) -> str:
    return f"{table}_default"


@dataclass(frozen=True)
class Partition:
    table: str  # the parent
    name: str
    lo: float | None  # None: the default partition
    hi: float | None


def partitions(conn: Connection, table: str) -> list[Partition]:
    """The partitions of `table` (in the connection's search_path), day partitions by start, the default last."""
    rows = conn.execute(text(
        "SELECT c.relname, pg_get_expr(c.relpartbound, c.oid) FROM pg_inherits i "
        "JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = to_regclass(:t)"), {"t": table}).all()
    out = []
    for name, bound in rows:
        m = _BOUND.search(bound or "")
        out.append(Partition(table, name, float(m.group(1)), float(m.group(2))) if m else
                   Partition(table, name, None, None))
    return sorted(out, key=lambda p: (p.lo is None, p.lo or 0.0))


def is_partitioned(conn: Connection, table: str) -> bool:
    return bool(conn.execute(text("SELECT 1 FROM pg_partitioned_table WHERE partrelid = to_regclass(:t)"),
                             {"t": table}).first())


def create_day(conn: Connection, table: str, day: float) -> bool:
    """Create `table`'s partition for the UTC day starting at `day`, moving in the rows the default partition
    holds for it; False when it exists. One transaction's work (the caller's): all of it or none. Two callers
    making the same day at once (two rollups) take turns: the second finds it made."""
    name = partition_name(table, day)
    conn.execute(text("SELECT pg_advisory_xact_lock(hashtext(current_schema() || '.' || :n))"), {"n": name})
    if conn.execute(text("SELECT to_regclass(:n)"), {"n": name}).scalar() is not None:
        return False
    lo, hi = float(day), float(day) + DAY
    default = default_name(table)
    has_default = conn.execute(text("SELECT to_regclass(:n)"), {"n": default}).scalar() is not None
    conn.execute(text(f"CREATE TABLE {name} (LIKE {table} INCLUDING DEFAULTS)"))
    if has_default:
        # writers wait a moment rather than slip a row of this day into the default between the move and the
        # attach (which would make the attach fail and roll everything back)
        conn.execute(text(f"LOCK TABLE {default} IN ACCESS EXCLUSIVE MODE"))
        conn.execute(text(f"INSERT INTO {name} SELECT * FROM {default} WHERE ts >= {lo!r} AND ts < {hi!r}"))
        conn.execute(text(f"DELETE FROM {default} WHERE ts >= {lo!r} AND ts < {hi!r}"))
    # the bound as a float literal: ts is double precision
    conn.execute(text(f"ALTER TABLE {table} ATTACH PARTITION {name} FOR VALUES FROM ({lo!r}) TO ({hi!r})"))
    return True


def ensure_partitions(store: Store, start: float | None = None, end: float | None = None,
                      days_ahead: int = 2) -> list[str]:
    """Day partitions of both sample tables from the day of `start` (default: today) to `days_ahead` days past
    `end` (default: now), each created (and filled from the default partition) in its own transaction; returns
    the names created. Idempotent; nothing on SQLite or on tables that are not partitioned."""
    if not store.is_postgres:
        return []
    now = time.time()
    first = day_of(now if start is None else start)
    last = day_of(now if end is None else end) + days_ahead * DAY
    if last < first:
        raise InvalidInput(f"partitions from {first} to {last}: the end is before the start")
    if (last - first) / DAY > 3660:
        raise InvalidInput("asked for more than ten years of day partitions; check the times given (epoch seconds)")
    created = []
    for table in SAMPLE_TABLES:
        with store.engine.connect() as conn:
            if not is_partitioned(conn, table):
                continue
        day = first
        while day <= last:
            with store.engine.begin() as conn:
                if create_day(conn, table, day):
                    created.append(partition_name(table, day))
            day += DAY
    return created


def early_rows_days(store: Store) -> list[float]:
    """The days the default partitions hold rows of (rows that came before their day's partition). Rows at a time
    no day partition can hold (has_day) are left where they are, said once per call: one such row must not stop
    every other day's rows from moving, nor the hourly rollup that moves them."""
    if not store.is_postgres:
        return []
    days: set[float] = set()
    with store.engine.connect() as conn:
        for table in SAMPLE_TABLES:
            default = default_name(table)
            if conn.execute(text("SELECT to_regclass(:n)"), {"n": default}).scalar() is None:
                continue
            for (d,) in conn.execute(text(f"SELECT DISTINCT floor(ts / {DAY!r}) * {DAY!r} FROM {default}")):
                days.add(float(d))
    outside = sorted(d for d in days if not has_day(d))
    if outside:
        log.warning("the default sample partitions hold rows at times no day partition can hold (days starting %s); "
                    "they stay there: a writer's clock or time unit is wrong", ", ".join(map(repr, outside[:5])))
    return sorted(d for d in days if has_day(d))


def adopt_early_rows(store: Store) -> list[str]:
    """Create the partitions of every day the default partitions hold rows of, which moves those rows."""
    created = []
    for day in early_rows_days(store):
        created += ensure_partitions(store, day, day, days_ahead=0)
    return created


def drop_days_before(store: Store, cutoff: float,
                     rows_if_droppable: Callable[[Connection, Partition], int | None]) -> dict[str, int]:
    """Drop the day partitions that end at or before `cutoff` and that `rows_if_droppable` allows (it sees the
    connection and the partition, e.g. to check every hour of it is rolled up, and returns the partition's row
    count, or None to keep it); each in its own transaction, which holds the partition against writes from the check
    to the drop (a late row between them would go with it). Returns {name dropped: rows it held}."""
    if not store.is_postgres:
        return {}
    dropped: dict[str, int] = {}
    for table in SAMPLE_TABLES:
        with store.engine.connect() as conn:
            if not is_partitioned(conn, table):
                continue
            old = [p for p in partitions(conn, table) if p.hi is not None and p.hi <= cutoff]
        for part in old:
            try:
                with store.engine.begin() as conn:
                    # no row may come in between the check and the drop (a late batch from a spool): writers of this
                    # day wait (only they: a write locks the partitions its rows go to)
                    conn.execute(text(f"LOCK TABLE {part.name} IN SHARE MODE"))
                    rows = rows_if_droppable(conn, part)
                    if rows is not None:
                        conn.execute(text(f"DROP TABLE {part.name}"))
                        dropped[part.name] = rows
            except DBAPIError as exc:
                if not is_contention(exc):
                    raise
                # such a writer holds the parent table, which the drop needs: one of the two is the deadlock's
                # victim; when it is this drop, the day stays until the next retention
                log.warning("partition %s was not dropped: a writer of its day came meanwhile (%s)", part.name,
                            str(getattr(exc, "orig", exc)).splitlines()[0])
    return dropped
