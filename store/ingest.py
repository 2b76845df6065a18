"""Bulk ingestion of device and process samples: COPY on PostgreSQL, one executemany transaction on SQLite.

Columns are written in the order of the sample rows (store.samples); a row may be a tuple in that order
(a DeviceSampleRow, a plain tuple or list) or a mapping by column name. A writer that has its samples as columns
(the Prometheus importer's numpy arrays) gives them as Arrow record batches instead (write_sample_batches_on): on
PostgreSQL pgpq encodes a batch into COPY's binary format in one call, with no Python object per value.
"""

from __future__ import annotations

import math
import sqlite3
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg
import pyarrow as pa
from pgpq import ArrowToPostgresBinaryEncoder
from sqlalchemy import Connection, select
from sqlalchemy.exc import OperationalError

from store import late_hours
from store.db import Store, is_disk_full, is_read_only
from store.errors import DatabaseBusy, InvalidInput, PartitionMissing
from store.models import DeviceSample, ProcessSample
from store.samples import DEVICE_SAMPLE_COLUMNS, PROCESS_SAMPLE_COLUMNS

Row = Mapping[str, Any] | Sequence[Any]
_DEVICE_TS = DEVICE_SAMPLE_COLUMNS.index("ts")
_PROCESS_TS = PROCESS_SAMPLE_COLUMNS.index("ts")


def _as_tuples(rows: Iterable[Row], columns: tuple[str, ...], *, ts_at: int | None = None, before: float = 0.0,
               hours: set[float] | None = None) -> Iterable[tuple[Any, ...]]:
    """Rows as tuples in column order; mappings may leave out columns that are missing (NULL). With `hours`, the
    start of the hour of each row whose time (column `ts_at`) is before `before` is added to it (store.late_hours:
    the closed hours a write reaches), in the same pass: the check costs two comparisons a row, no call."""
    width = len(columns)
    lo = hi = 0.0  # the hour last added: its rows need no floor() again
    for row in rows:
        kind = type(row)
        if kind is tuple and len(row) == width:  # rows already in column order: no conversion at all
            out = row
        elif kind is list and len(row) == width:
            out = tuple(row)
        elif isinstance(row, tuple) and len(row) == width and hasattr(row, "_fields"):  # a typed sample row
            out = row
        elif kind is dict or isinstance(row, Mapping):
            out = tuple(map(row.get, columns))
        else:
            if len(row) != width:
                raise ValueError(f"a sample row has {len(row)} values; expected {width}: {columns}")
            out = tuple(row)
        if hours is not None:
            ts = out[ts_at]
            try:
                if ts < before and not lo <= ts < hi:
                    lo = math.floor(ts / late_hours.HOUR) * late_hours.HOUR
                    hi = lo + late_hours.HOUR
                    hours.add(lo)
            except TypeError:  # not a time: the database refuses the row
                pass
        yield out


def _copy(cursor, table: str, columns: tuple[str, ...], rows: Iterable[tuple[Any, ...]]) -> int:
    n = 0
    # Binary COPY with declared types: no per-value text formatting, the fastest path psycopg 3 has.
    with cursor.copy(f"COPY {table} ({', '.join(columns)}) FROM STDIN (FORMAT BINARY)") as copy:
        copy.set_types(_pg_types(table, columns))
        for row in rows:
            copy.write_row(row)
            n += 1
    return n


# each sample column's type as PostgreSQL's binary COPY and Arrow name it, by the model's SQLAlchemy type
_TYPES = {"BigInteger": ("int8", pa.int64()), "Integer": ("int4", pa.int32()), "Double": ("float8", pa.float64()),
          "String": ("text", pa.string())}


def _column_types(table: str, columns: tuple[str, ...]) -> list[tuple[str, pa.DataType]]:
    model = DeviceSample if table == "device_samples" else ProcessSample
    return [_TYPES[type(model.__table__.columns[name].type).__name__] for name in columns]


def _pg_types(table: str, columns: tuple[str, ...]) -> list[str]:
    return [pg for pg, _ in _column_types(table, columns)]


def _arrow_batch(table: str, columns: tuple[str, ...], batch: pa.RecordBatch) -> pa.RecordBatch:
    """`batch` with the table's column types (int8, int4, float8, text), in `columns` order; a column it lacks is
    NULL."""
    unknown = set(batch.schema.names) - set(columns)
    if unknown:
        raise ValueError(f"a {table} batch has columns the table has not: {sorted(unknown)}; expected {columns}")
    arrays = []
    for name, (_, kind) in zip(columns, _column_types(table, columns), strict=True):
        if name in batch.schema.names:
            col = batch.column(name)
            try:
                arrays.append(col if col.type == kind else col.cast(kind))
            except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
                raise InvalidInput(f"the {table} batch's {name} ({col.type}) does not fit its {kind} column, "
                                   f"nothing of it was written: {exc}") from None
        else:
            arrays.append(pa.nulls(batch.num_rows, kind))
    return pa.RecordBatch.from_arrays(arrays, names=list(columns))


def _copy_batch(cursor, table: str, batch: pa.RecordBatch) -> int:
    """The batch in one binary COPY, encoded by pgpq (the same bytes psycopg's write_row makes, row by row)."""
    encoder = ArrowToPostgresBinaryEncoder(batch.schema)
    with cursor.copy(f"COPY {table} ({', '.join(batch.schema.names)}) FROM STDIN (FORMAT BINARY)") as copy:
        copy.write(encoder.write_header())
        copy.write(encoder.write_batch(batch))
        copy.write(encoder.finish())
    return batch.num_rows


def _executemany_batch(cursor, table: str, batch: pa.RecordBatch) -> int:
    columns = tuple(batch.schema.names)
    return _executemany(cursor, table, columns, zip(*(c.to_pylist() for c in batch.columns), strict=True))


def _executemany(cursor, table: str, columns: tuple[str, ...], rows: Iterable[tuple[Any, ...]]) -> int:
    # executemany pulls rows from the iterator as it goes, so a stream is never held in memory.
    sql = f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})"
    cursor.executemany(sql, rows)
    return max(cursor.rowcount, 0)


def write_samples(
    store: Store, device_rows: Iterable[Row] = (), process_rows: Iterable[Row] = ()
) -> tuple[int, int]:
    """Write a batch of device and process samples in one transaction; returns (devices, processes) written.

    Either every row of the batch is written or none is (the agent keeps its spool until this returns).
    """
    with sample_errors(store), store.engine.begin() as conn:
        return write_samples_on(conn, store.is_postgres, device_rows, process_rows)


def write_samples_once(
    store: Store, device_rows: Iterable[Row] = (), process_rows: Iterable[Row] = ()
) -> tuple[int, int]:
    """write_samples for a batch that may be in the store already, whole or not at all: a spooled batch written just
    before its agent died, before it could forget it, or one whose commit answer the connection lost. A row the
    store holds (a device sample of the same device and time, a process sample of the same device, pid and time,
    unique as the agents write them) is left out, so writing the batch again adds nothing. The batch's devices are
    read over its time span first, in the same transaction, through the (device_id, ts) indexes: one more query
    per batch, for batches sent again, not for every batch."""
    device = list(_as_tuples(device_rows, DEVICE_SAMPLE_COLUMNS))
    process = list(_as_tuples(process_rows, PROCESS_SAMPLE_COLUMNS))
    with sample_errors(store), store.engine.begin() as conn:
        if device:
            held = _stored(conn, device, DeviceSample.ts, DEVICE_SAMPLE_COLUMNS.index("ts"), DeviceSample.device_id)
            device = [r for r in device if (r[0], r[1]) not in held]
        if process:
            pid, ts = PROCESS_SAMPLE_COLUMNS.index("pid"), PROCESS_SAMPLE_COLUMNS.index("ts")
            held = _stored(conn, process, ProcessSample.ts, ts, ProcessSample.device_id, ProcessSample.pid)
            process = [r for r in process if (r[0], r[pid], r[ts]) not in held]
        return write_samples_on(conn, store.is_postgres, device, process)


def _stored(conn: Connection, rows: list[tuple[Any, ...]], ts_column: Any, ts_at: int, *key: Any) -> set[tuple]:
    """The keys (`key` columns, then ts) the store holds for the devices of `rows` within their time span."""
    times = [r[ts_at] for r in rows]
    query = (select(*key, ts_column).where(key[0].in_(sorted({r[0] for r in rows})), ts_column >= min(times),
                                           ts_column <= max(times)))
    return set(conn.execute(query).tuples())


def write_samples_on(
    conn: Connection, is_postgres: bool, device_rows: Iterable[Row] = (), process_rows: Iterable[Row] = ()
) -> tuple[int, int]:
    """write_samples inside the caller's transaction (`conn`), for a caller that writes other rows with the
    samples and wants all or none of them; wrap it in sample_errors(store) for the same messages. The closed hours
    written into are marked in the same transaction, for the next rollup to roll them up again (store.late_hours)."""
    before, hours = late_hours.closed_before(), set()
    device = _as_tuples(device_rows, DEVICE_SAMPLE_COLUMNS, ts_at=_DEVICE_TS, before=before, hours=hours)
    process = _as_tuples(process_rows, PROCESS_SAMPLE_COLUMNS, ts_at=_PROCESS_TS, before=before, hours=hours)
    write = _copy if is_postgres else _executemany
    cursor = conn.connection.driver_connection.cursor()
    try:
        counts = (write(cursor, "device_samples", DEVICE_SAMPLE_COLUMNS, device),
                  write(cursor, "process_samples", PROCESS_SAMPLE_COLUMNS, process))
    finally:
        cursor.close()
    late_hours.mark(conn, is_postgres, hours)
    return counts


def write_sample_batches(
    store: Store, device: pa.RecordBatch | None = None, process: pa.RecordBatch | None = None
) -> tuple[int, int]:
    """write_samples for samples held as columns (see write_sample_batches_on): all of both batches or nothing."""
    with sample_errors(store), store.engine.begin() as conn:
        return write_sample_batches_on(conn, store.is_postgres, device, process)


def write_sample_batches_on(
    conn: Connection, is_postgres: bool, device: pa.RecordBatch | None = None, process: pa.RecordBatch | None = None,
    *, late: set[float] | None = None,
) -> tuple[int, int]:
    """write_samples_on for samples held as columns: Arrow record batches named by the tables' columns (a column a
    batch lacks is NULL; values are cast to the column's type, so integral floats may stand for BIGINT).

    With `late`, the closed hours the batches reach are added to it instead of marked: the caller marks them
    (store.late_hours.mark) later in the same transaction. A writer that holds its transaction open while it waits
    for another's commit must: a mark holds its hour's row until the commit, and the other may need that row."""
    write = _copy_batch if is_postgres else _executemany_batch
    cursor = conn.connection.driver_connection.cursor()
    try:
        counts = []
        for table, columns, batch in (("device_samples", DEVICE_SAMPLE_COLUMNS, device),
                                      ("process_samples", PROCESS_SAMPLE_COLUMNS, process)):
            counts.append(0 if batch is None or not batch.num_rows else
                          write(cursor, table, _arrow_batch(table, columns, batch)))
    finally:
        cursor.close()
    before = late_hours.closed_before()
    hours = late_hours.batch_hours(device, before) | late_hours.batch_hours(process, before)
    if late is None:
        late_hours.mark(conn, is_postgres, hours)
    else:
        late.update(hours)
    return counts[0], counts[1]


@contextmanager
def sample_errors(store: Store) -> Iterator[None]:
    """Errors raised inside COPY or executemany come from the driver, not wrapped by SQLAlchemy: the database
    being away (or full, read-only, without a day's partition, attaching a row's day meanwhile) becomes
    DatabaseUnavailable or one of its kinds, a refused row InvalidInput."""
    try:
        yield
    except Exception as exc:
        if _is_connection_error(exc) or is_disk_full(exc):
            raise store.unavailable(exc) from None
        if is_read_only(exc):
            raise store.read_only(exc) from None
        if _is_partition_attached_meanwhile(exc):
            raise DatabaseBusy(f"the day partition of some rows was made at {store.masked_url} while this batch was "
                               f"written ({_reason(exc)}); nothing of it was written, and writers keep their batches "
                               "and try again") from None
        if _is_missing_partition(exc):
            raise PartitionMissing(f"the database at {store.masked_url} has no partition for some rows' days, "
                                   f"nothing of the batch was written ({_reason(exc)}); run `fleetlens init` to "
                                   "create the day partitions and the default one") from None
        if _is_data_error(exc):
            reason = _reason(exc)
            raise InvalidInput(f"the database refused a sample batch, nothing of it was written: {reason}") from None
        raise


def _reason(exc: BaseException) -> str:
    return str(getattr(exc, "orig", exc)).strip().splitlines()[0]


def _is_partition_attached_meanwhile(exc: BaseException) -> bool:
    """A row routed to the default partition before its day's partition was attached (partitions.create_day, which
    holds the default locked meanwhile) is refused when the lock is let go: the next try lands in the day."""
    orig = getattr(exc, "orig", exc)
    text = str(orig)
    return (getattr(orig, "sqlstate", None) == "23514" and "violates partition constraint" in text
            and '_default"' in text)


def _is_missing_partition(exc: BaseException) -> bool:
    orig = getattr(exc, "orig", exc)
    return getattr(orig, "sqlstate", None) == "23514" and "no partition of relation" in str(orig)


def _is_data_error(exc: BaseException) -> bool:
    orig = getattr(exc, "orig", exc)
    return isinstance(orig, sqlite3.IntegrityError | psycopg.IntegrityError | psycopg.DataError)


def _is_connection_error(exc: BaseException) -> bool:
    orig = getattr(exc, "orig", exc)
    if isinstance(orig, psycopg.OperationalError):
        return True
    if isinstance(orig, sqlite3.OperationalError):
        text = str(orig).lower()
        return "unable to open" in text or "locked" in text or "disk i/o" in text
    return isinstance(exc, OperationalError)
