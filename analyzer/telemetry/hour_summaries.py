"""Each closed hour's summary for the telemetry detectors, kept in `telemetry_hours` when the hour is rolled up.

Judging a day of a large fleet from its samples reads every sample of the day; judging it from the day's kept hours
reads 24 small rows. An hour is kept with the key of the thresholds that shaped it (what counts as held, idle and
orphaned, how long a run must be, the buckets and gap cap); detection under other thresholds (the demo's compressed
time, say) makes its pieces from the samples instead. Re-rolling an hour (late samples) replaces its summary.
"""

from __future__ import annotations

import hashlib
import io
import logging
import time

import pandas as pd
import pyarrow as pa
from sqlalchemy import delete, insert, select

from analyzer.telemetry.frame import fmt_ts
from analyzer.telemetry.summary import HIST_COLUMNS, PAIR_COLUMNS, RUN_COLUMNS, Piece
from analyzer.telemetry.thresholds import Thresholds
from store.db import Store
from store.models import TelemetryHour

log = logging.getLogger(__name__)

HOUR = 3600.0
FORMAT = "1"  # bumped when a piece's columns or meaning change: older kept hours are then not used


def thresholds_key(th: Thresholds) -> str:
    """What a kept hour depends on: the summary format and the thresholds used while making a piece."""
    c = th.common
    shaping = (FORMAT, c.bucket_s, c.held_min_gib, c.max_gap_factor, th.idle_holder.util_max,
               th.idle_holder.min_duration_s, th.zombie_memory.mem_min_gib, th.zombie_memory.min_duration_s)
    return hashlib.sha256(repr(shaping).encode()).hexdigest()[:32]


def _pack(frame: pd.DataFrame, columns: tuple[str, ...]) -> bytes:
    table = pa.Table.from_pandas(frame[list(columns)], preserve_index=False)
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema, options=pa.ipc.IpcWriteOptions(compression="zstd")) as writer:
        writer.write_table(table)
    return sink.getvalue()


def _unpack(blob: bytes) -> pd.DataFrame:
    with pa.ipc.open_stream(blob) as reader:
        return reader.read_all().to_pandas()


def keep_hours(store: Store, pieces: list[Piece], th: Thresholds) -> int:
    """Keep these pieces, each one whole hour, replacing what was kept for their hours; returns how many."""
    for p in pieces:
        if p.start % HOUR or p.end - p.start != HOUR:
            raise ValueError(f"a kept piece is one whole hour, not [{p.start}, {p.end})")
    if not pieces:
        return 0
    key, now = thresholds_key(th), time.time()
    rows = [{"hour": p.start, "key": key, "computed_at": now, "first_ts": p.first_ts, "last_end": p.last_end,
             "pairs": _pack(p.pairs, PAIR_COLUMNS), "hist": _pack(p.hist, HIST_COLUMNS),
             "runs": _pack(p.runs, RUN_COLUMNS)} for p in pieces]
    with store.session() as session:
        session.execute(delete(TelemetryHour).where(TelemetryHour.hour.in_([p.start for p in pieces])))
        session.execute(insert(TelemetryHour), rows)
    return len(rows)


def kept_hours(store: Store, start: float, end: float, th: Thresholds) -> list[Piece]:
    """The kept pieces of the whole hours inside [start, end) made under these thresholds."""
    first = -(-start // HOUR) * HOUR
    last = (end // HOUR) * HOUR  # the hours [first, last) lie inside the window
    if last <= first:
        return []
    h = TelemetryHour
    with store.session() as session:
        rows = session.execute(
            select(h.hour, h.first_ts, h.last_end, h.pairs, h.hist, h.runs)
            .where(h.hour >= first, h.hour < last, h.key == thresholds_key(th)).order_by(h.hour)
        ).all()
    pieces = []
    for hour, first_ts, last_end, pairs, hist, runs in rows:
        try:
            frames = [_unpack(pairs), _unpack(hist), _unpack(runs)]
        except (pa.ArrowException, OSError) as exc:
            # a kept hour that cannot be read is judged from its samples, as if it had not been kept
            log.warning("the kept summary of hour %s cannot be read (%s); reading its samples instead",
                        fmt_ts(hour), exc)
            continue
        pieces.append(Piece(float(hour), float(hour) + HOUR, first_ts, last_end, *frames))
    return pieces


def uncovered(start: float, end: float, kept: list[Piece]) -> list[tuple[float, float]]:
    """The parts of [start, end) no kept piece covers, in order."""
    gaps: list[tuple[float, float]] = []
    at = start
    for p in sorted(kept, key=lambda p: p.start):
        if p.start > at:
            gaps.append((at, p.start))
        at = max(at, p.end)
    if at < end:
        gaps.append((at, end))
    return gaps
