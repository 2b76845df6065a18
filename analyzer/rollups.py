"""Hourly rollups per workflow and per device from raw samples, and retention that only drops rolled-up hours.

Definitions (a sample stands for `dt` seconds, see analyzer.telemetry.frame):

- held, per device: a workflow held the device during the sample (below), or, with no workflow's
  process on it, at least `held_min_gib` of its memory was in use. gpu_hours_held = sum of dt over held
  samples / 3600, times the device's share of a whole GPU (analyzer.device_share: 1 for a GPU, 1/7 for an
  A100's 1g.10gb MIG slice), so that GPU-hours of MIG slices and of whole GPUs add up; active likewise.
- held, per workflow: the workflow's processes held the device during the sample (same rule, for its
  own processes); a device shared by n workflows at that sample counts 1/n for each, so workflow
  GPU-hours add up to device GPU-hours.
- active = held x utilisation: per device, dt x gpu_util over held samples; per workflow, dt x the
  process's own SM utilisation when the source records it, else dt x gpu_util x 1/n. Capped at held.
- util_mean / util_p95 / sm_active_mean: over the device samples of the hour (per workflow: of the
  samples where it held a device). mem_peak: the largest memory in use (per workflow: its processes'
  memory on one device); mem_total: that device's memory.
- samples: device samples (per device) or raw process-sample rows (per workflow) in the hour; the
  retention compares it with the raw rows before deleting, so an hour that changed after it was
  rolled up is never deleted.

Only closed hours (ending at or before `now`) are rolled up. Re-running upserts on
(scope, subject, hour), so it is idempotent. Each rolled-up hour also keeps the telemetry detectors' summary of it
(analyzer.telemetry.hour_summaries), replaced when the hour is rolled up again.

Late samples: an hour that samples reach after it closed (an agent's spool sent when the database came back, an
import of the past) is marked by the write itself (store.late_hours); the next rollup rolls each marked hour up
again, its summary with it, if it lies within the rollup's look-back (`recheck_days`, the retention's days where the
periodic jobs call it: the retention deletes no sample younger, so such an hour is whole), and clears its mark unless
a write came since. So a rollup reads the samples of the hours that changed only, whatever the store holds.
"""

from __future__ import annotations

import logging
import math
import time
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import numpy as np
import pandas as pd
from sqlalchemy import Integer, cast, delete, func, select, text
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from analyzer.device_share import share_of
from analyzer.telemetry.chunks import device_groups
from analyzer.telemetry.frame import ReadPlan, TelemetryWindow, load_window, read_plan, read_registry, read_rows
from analyzer.telemetry.hour_summaries import keep_hours
from analyzer.telemetry.summary import Piece, merged, summarise
from analyzer.telemetry.thresholds import Thresholds, load_thresholds
from store import late_hours
from store.db import Store
from store.errors import InvalidInput
from store.models import DeviceSample, ProcessSample, Rollup, TelemetryHour
from store.partitions import SAMPLE_TABLES, Partition, drop_days_before
from store.serving_raw import delete_raw_before

log = logging.getLogger(__name__)

HOUR = 3600.0
DAY = 86400.0
# how far back a rollup looks for hours that samples reached after they were rolled up: the default retention
# (FLEETLENS_RETENTION_DAYS), beyond which raw samples are gone; the periodic jobs pass the store's own
RECHECK_DAYS = 7.0
CHUNK_HOURS = 6  # hours read per query: bounded memory on a large fleet
# a fleet larger than this is rolled up in groups of devices (a workflow's devices together, as the detectors read
# it), GROUP_THREADS at once: memory stays bounded, and the database's reading of one group overlaps the other's
GROUP_DEVICES = 5000
GROUP_THREADS = 2
_UPDATED = ("team", "samples", "gpu_hours_held", "gpu_hours_active", "util_mean", "util_p95", "sm_active_mean",
            "mem_peak", "mem_total", "computed_at")


@dataclass(frozen=True)
class RollupResult:
    hours: int  # closed hours processed from `since` on
    device_rows: int  # rows written, of those hours and of the re-rolled ones
    workflow_rows: int
    first_hour: float | None  # the first and last of the `hours`
    last_hour: float | None
    rerolled_hours: tuple[float, ...] = ()  # earlier hours rolled up again: their raw samples outnumbered their rollups


@dataclass(frozen=True)
class RetentionResult:
    cutoff: float
    device_samples_deleted: int
    process_samples_deleted: int
    hours_kept: int  # (subject, hour) pairs older than the cutoff kept because the rollup has not reached them yet
    partitions_dropped: tuple[str, ...] = ()  # PostgreSQL: whole days dropped (their rows are in the counts)
    summaries_deleted: int = 0  # kept hours of the detectors (telemetry_hours) older than the cutoff
    serving_requests_deleted: int = 0  # opt-in raw serving requests older than the cutoff (the minutes keep them)
    # rows (in the two counts above too) of hours the rollup had passed that differ from their rollups: samples that
    # came after their hour was rolled up, too late for any rollup to take them (before its look-back, the
    # retention's days): past the retention, they would otherwise stay for good
    late_samples_deleted: int = 0


def hour_of(ts: float) -> float:
    return math.floor(ts / HOUR) * HOUR


def _hour_expr(store: Store, column):
    """The SQL start of the hour of an epoch-seconds column (floor; SQLite has no floor() everywhere)."""
    if store.is_postgres:
        return func.floor(column / HOUR) * HOUR
    return cast(column / HOUR, Integer) * HOUR  # timestamps are positive, so truncation is floor


def hour_runs(hours: list[float]) -> list[tuple[float, float]]:
    """Contiguous [start, end) runs of these hour starts (sorted)."""
    runs: list[tuple[float, float]] = []
    for h in hours:
        if runs and runs[-1][1] == h:
            runs[-1] = (runs[-1][0], h + HOUR)
        else:
            runs.append((h, h + HOUR))
    return runs


def _default_since(store: Store) -> float | None:
    """The hour after the last rolled one (samples that reach it or an earlier one later mark it: store.late_hours);
    with no rollups, the oldest sample's hour."""
    with store.session() as session:
        last = session.scalar(select(func.max(Rollup.hour)))
        if last is not None:
            return float(last) + HOUR
        first = session.scalar(select(func.min(DeviceSample.ts)))
        first_p = session.scalar(select(func.min(ProcessSample.ts)))
    starts = [x for x in (first, first_p) if x is not None]
    return hour_of(min(starts)) if starts else None


def _next_sample_ts(store: Store, after: float) -> float | None:
    with store.session() as session:
        found = [
            session.scalar(select(func.min(model.ts)).where(model.ts >= after))
            for model in (DeviceSample, ProcessSample)
        ]
    found = [float(x) for x in found if x is not None]
    return min(found) if found else None


class _InThisThread(Executor):
    """An executor that runs each task at once in the calling thread."""

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # handed to whoever asks for the result, as a thread pool would
            future.set_exception(exc)
        return future


def _roll_group(store: Store, start: float, end: float, th: Thresholds, plan: ReadPlan, devices: list[int] | None,
                computed_at: float, registry: tuple[pd.DataFrame, pd.DataFrame]
                ) -> tuple[list[dict], list[dict], list[Piece]] | None:
    """(device rollups, workflow rollups, each hour's detector summary) of [start, end) for these devices (None: all
    of them); None when they have no samples then. `registry`: read_registry's devices and workflows."""
    window = load_window(store, start, end, th.common, devices, rows=read_rows(store, plan, th.common, devices),
                         registry=registry)
    if window.samples.empty and window.processes.empty:
        return None
    pieces = [summarise(window, th, h, h + HOUR) for h in np.arange(start, end, HOUR)]
    return device_rollups(window, computed_at), workflow_rollups(window, computed_at), pieces


def rollup(
    store: Store,
    now: float | None = None,
    since: float | None = None,
    *,
    thresholds: Thresholds | None = None,
    recheck_days: float = RECHECK_DAYS,
) -> RollupResult:
    """Roll up every closed hour from `since` (default: the hour after the last rolled one, else the oldest sample's)
    to `now`, and again every earlier hour of the last `recheck_days` days (0: none) that samples were written into
    after it closed (store.late_hours). A marked hour outside the look-back keeps its mark (a rollup with a longer one
    rolls it up; the retention drops it with the hour's samples)."""
    if recheck_days is None or not 0 <= recheck_days < math.inf:
        raise InvalidInput(f"recheck_days must be a finite number of days, 0 or more, got {recheck_days!r}")
    th = thresholds or load_thresholds()
    now = time.time() if now is None else float(now)
    end = hour_of(now)
    since = _default_since(store) if since is None else hour_of(float(since))
    if since is None:
        return RollupResult(0, 0, 0, None, None)
    since = min(since, end)
    # the marks are read before any sample: a write that comes later changes its mark's version, so the mark stays
    marked = late_hours.marks(store, end)
    # the marked hours before `since` still within the look-back (the retention deletes no sample younger): whole
    # hours, as the retention's cutoff
    lookback = hour_of(now - recheck_days * DAY) if recheck_days > 0 else since
    stale = [h for h in marked if lookback <= h < since]
    ranges = [*hour_runs(stale), *([(since, end)] if since < end else [])]
    if not ranges:
        return RollupResult(0, 0, 0, None, None)
    n_dev = n_wf = 0
    computed_at = time.time()
    registry = read_registry(store)  # devices and workflows, read once for every chunk and group
    # PostgreSQL serves several connections at once; SQLite (one host, one writer) does everything in this thread
    with (ThreadPoolExecutor(max_workers=GROUP_THREADS, thread_name_prefix="fleetlens-rollup") if store.is_postgres
          else _InThisThread()) as pool:
        for lo, hi in ranges:
            dev, wf = _roll_range(store, pool, lo, hi, th, computed_at, registry)
            n_dev, n_wf = n_dev + dev, n_wf + wf
    # every hour rolled up now holds the samples of the writes its mark had seen
    late_hours.clear(store, {h: v for h, v in marked.items() if lookback <= h < end})
    if since < end:
        return RollupResult(int((end - since) // HOUR), n_dev, n_wf, since, end - HOUR, tuple(stale))
    return RollupResult(0, n_dev, n_wf, None, None, tuple(stale))


def _roll_range(store: Store, pool: Executor, start: float, end: float, th: Thresholds, computed_at: float,
                registry: tuple[pd.DataFrame, pd.DataFrame]) -> tuple[int, int]:
    """Roll up the hours of [start, end) (whole hours), CHUNK_HOURS at a time; returns (device rows, workflow
    rows) written."""
    n_dev = n_wf = 0
    chunk_start = start
    while chunk_start < end:
        chunk_end = min(chunk_start + CHUNK_HOURS * HOUR, end)
        # how to read the chunk and how to split it are asked of the database at once
        planned = pool.submit(read_plan, store, chunk_start, chunk_end, th.common)
        groups = device_groups(store, chunk_start, chunk_end, GROUP_DEVICES)
        plan = planned.result()
        done = list(pool.map(partial(_roll_group, store, chunk_start, chunk_end, th, plan,
                                     computed_at=computed_at, registry=registry), groups))
        done = [d for d in done if d is not None]
        if not done:
            # a hole in the data (or a store idle for months): jump to the hour of the next sample
            nxt = _next_sample_ts(store, chunk_end)
            chunk_start = end if nxt is None else max(chunk_end, hour_of(nxt))
            continue
        dev_rows = [row for rows, _, _ in done for row in rows]
        wf_rows = [row for _, rows, _ in done for row in rows]
        # the rollups, and the detectors' summary of each hour (judging a day reads 24 of these instead of its
        # samples), written at once on two connections (PostgreSQL)
        kept = pool.submit(keep_hours, store, [merged(list(same_hour)) for same_hour in
                                               zip(*(pieces for _, _, pieces in done), strict=True)], th)
        _upsert(store, dev_rows + wf_rows)
        kept.result()
        n_dev, n_wf = n_dev + len(dev_rows), n_wf + len(wf_rows)
        chunk_start = chunk_end
    return n_dev, n_wf


def _none(x) -> float | None:
    return None if x is None or pd.isna(x) else float(x)


def _int(x) -> int | None:
    return None if x is None or pd.isna(x) else int(x)


def _shares(window: TelemetryWindow, device_ids: pd.Series) -> np.ndarray:
    """Each row's device's share of a whole GPU (analyzer.device_share)."""
    devices = window.devices
    if devices is None or devices.empty or "name" not in devices:
        return np.ones(len(device_ids))
    mem = devices["memory_total"] if "memory_total" in devices else pd.Series(index=devices.index, dtype="float64")
    share = pd.Series([share_of(n, m if pd.notna(m) else None) for n, m in zip(devices["name"], mem, strict=True)],
                      index=devices.index, dtype="float64")
    return device_ids.map(share).fillna(1.0).to_numpy(dtype="float64")


def device_rollups(window: TelemetryWindow, computed_at: float) -> list[dict]:
    """One row per (device, hour) of the window's device samples."""
    s = window.samples
    if s.empty:
        return []
    s = s.assign(hour=np.floor(s["ts"] / HOUR) * HOUR)
    s["held_s"] = s["dt"].where(s["held"], 0.0) * _shares(window, s["device_id"])
    s["active_s"] = (s["held_s"] * s["gpu_util"].fillna(0.0).clip(0.0, 1.0))
    g = s.groupby(["device_id", "hour"], sort=False)
    out = g.agg(
        samples=("n_raw", "sum"), held_s=("held_s", "sum"), active_s=("active_s", "sum"),
        util_mean=("gpu_util", "mean"), sm_active_mean=("sm_active", "mean"),
        mem_peak=("mem_used", "max"), mem_total=("mem_total", "max"),
    )
    out["util_p95"] = g["gpu_util"].quantile(0.95)
    return [
        {
            "scope": "device", "subject": str(dev), "hour": float(hour), "team": None, "samples": int(r.samples),
            "gpu_hours_held": float(r.held_s) / HOUR, "gpu_hours_active": float(r.active_s) / HOUR,
            "util_mean": _none(r.util_mean), "util_p95": _none(r.util_p95), "sm_active_mean": _none(r.sm_active_mean),
            "mem_peak": _int(r.mem_peak), "mem_total": _int(r.mem_total), "computed_at": computed_at,
        }
        for r in out.itertuples()  # r.Index is (device, hour); itertuples is many times faster than iterrows
        for dev, hour in (r.Index,)
    ]


def workflow_rollups(window: TelemetryWindow, computed_at: float) -> list[dict]:
    """One row per (workflow, hour) that has process samples in the window."""
    procs = window.processes
    if procs.empty:
        return []
    counts = procs.assign(hour=np.floor(procs["ts"] / HOUR) * HOUR).groupby(["workflow_id", "hour"])["n_raw"].sum()
    u = window.usage
    u = u.assign(hour=np.floor(u["ts"] / HOUR) * HOUR)
    held = u["held"]
    u["held_s"] = (u["dt"] * u["share"] * _shares(window, u["device_id"])).where(held, 0.0)
    own = u["sm_util"].where(u["sm_util"].notna(), u["gpu_util"] * u["share"])
    u["active_s"] = np.minimum(u["dt"] * own.fillna(0.0).clip(lower=0.0), u["held_s"])
    # utilisation and memory statistics describe the samples where the workflow held a device
    hu = u[held]
    g = hu.groupby(["workflow_id", "hour"], sort=False)
    stats = g.agg(util_mean=("gpu_util", "mean"), sm_active_mean=("sm_active", "mean"),
                  mem_peak=("wf_mem", "max"), mem_total=("mem_total", "max"))
    stats["util_p95"] = g["gpu_util"].quantile(0.95)
    sums = u.groupby(["workflow_id", "hour"], sort=False)[["held_s", "active_s"]].sum()
    out = pd.DataFrame({"samples": counts}).join(sums, how="left").join(stats, how="left")
    teams = window.workflows["team"] if "team" in window.workflows else pd.Series(dtype="object")
    rows = []
    for r in out.itertuples():
        wf, hour = r.Index
        team = teams.get(wf)
        rows.append({
            "scope": "workflow", "subject": str(wf), "hour": float(hour),
            "team": None if team is None or pd.isna(team) else str(team), "samples": int(r.samples),
            "gpu_hours_held": (_none(r.held_s) or 0.0) / HOUR, "gpu_hours_active": (_none(r.active_s) or 0.0) / HOUR,
            "util_mean": _none(r.util_mean), "util_p95": _none(r.util_p95), "sm_active_mean": _none(r.sm_active_mean),
            "mem_peak": _int(r.mem_peak), "mem_total": _int(r.mem_total), "computed_at": computed_at,
        })
    return rows


def _upsert(store: Store, rows: list[dict], batch: int = 2000) -> None:
    if not rows:
        return
    if store.is_postgres:
        _upsert_copied(store, rows)
        return
    stmt = sqlite_insert(Rollup)
    stmt = stmt.on_conflict_do_update(
        index_elements=["scope", "subject", "hour"], set_={c: stmt.excluded[c] for c in _UPDATED}
    )
    with store.session() as session:
        for i in range(0, len(rows), batch):
            session.execute(stmt, rows[i:i + batch])


_COLUMNS = ("scope", "subject", "hour", *_UPDATED)


def _upsert_copied(store: Store, rows: list[dict]) -> None:
    """PostgreSQL: the rows copied into a temporary table, then upserted from it in one statement (a fleet's hour is
    tens of thousands of rows, which parameter-bound inserts spend most of their time binding)."""
    cols = ", ".join(_COLUMNS)
    updates = ", ".join(f"{c} = EXCLUDED.{c}" for c in _UPDATED)
    with store.engine.begin() as conn:
        cursor = conn.connection.driver_connection.cursor()
        try:
            cursor.execute(f"CREATE TEMPORARY TABLE rollups_in ON COMMIT DROP AS SELECT {cols} FROM rollups "
                           "WITH NO DATA")
            with cursor.copy(f"COPY rollups_in ({cols}) FROM STDIN") as copy:
                for row in rows:
                    copy.write_row(tuple(row[c] for c in _COLUMNS))
            cursor.execute(f"INSERT INTO rollups ({cols}) SELECT {cols} FROM rollups_in "
                           f"ON CONFLICT (scope, subject, hour) DO UPDATE SET {updates}")
        finally:
            cursor.close()


def apply_retention(store: Store, retention_days: float, now: float | None = None) -> RetentionResult:
    """Delete raw samples older than `retention_days`, but only of hours already rolled up unchanged, or that no
    rollup will take any more.

    A (device, hour) of device samples goes when a device rollup of that hour exists and counted exactly the rows
    still there; likewise a (workflow, hour) of process samples. An hour the rollup has not reached yet stays (roll it
    up, then run the retention again). An hour the rollup has passed whose rows differ from its rollups holds samples
    that came after it was rolled up, older than the rollup's look-back (the retention's days, as the periodic jobs
    and `fleetlens rollup` run it): no rollup rolls it up again, so its rows go too, counted in
    `late_samples_deleted`.
    """
    if retention_days is None or not 0 < retention_days < math.inf:
        raise InvalidInput(f"retention_days must be a positive, finite number of days, got {retention_days!r}")
    now = time.time() if now is None else float(now)
    cutoff = hour_of(now - retention_days * 86400.0)  # whole hours only
    # PostgreSQL: a day whose every hour is rolled up goes as one partition; what is left goes row by row
    dropped = drop_days_before(store, cutoff, _rolled_up_rows)
    by_table = {t: sum(n for name, n in dropped.items() if name.startswith(t + "_")) for t in SAMPLE_TABLES}
    with store.session() as session:
        last = session.scalar(select(func.max(Rollup.hour)))
    # the rollup rolls up from the hour after its last (analyzer.rollups._default_since): an hour before that it
    # has passed, and rolls up again only if marked late and within its look-back
    passed = -math.inf if last is None else float(last) + HOUR
    dev_deleted, dev_kept, dev_late = _retain(store, DeviceSample, DeviceSample.device_id, "device", cutoff, passed,
                                              int)
    proc_deleted, proc_kept, proc_late = _retain(store, ProcessSample, ProcessSample.workflow_id, "workflow", cutoff,
                                                 passed, str)
    if dev_late or proc_late:
        log.warning("retention: %d device and %d process samples of hours before %.0f came after their hours were "
                    "rolled up, too late for any rollup; deleted with their hours", dev_late, proc_late, cutoff)
    # the detectors' kept hours live as long as the samples they summarise: the table stays a week of hours
    with store.session() as session:
        summaries = session.execute(delete(TelemetryHour).where(TelemetryHour.hour < cutoff)).rowcount
        late_hours.drop_before(session, cutoff)  # their samples are the retention's now, not a rollup's
        raw_requests = delete_raw_before(session, cutoff)
    return RetentionResult(cutoff, dev_deleted + by_table["device_samples"],
                           proc_deleted + by_table["process_samples"], dev_kept + proc_kept, tuple(sorted(dropped)),
                           summaries, raw_requests, dev_late + proc_late)


def _rolled_up_rows(conn, part: Partition) -> int | None:
    """The rows of a day partition when each of its hours holds exactly the samples its rollups counted (so
    dropping it loses nothing the rollups do not have), else None."""
    scope = "device" if part.table == DeviceSample.__tablename__ else "workflow"
    raw = {float(h): int(n) for h, n in conn.execute(text(
        f"SELECT floor(ts / {HOUR!r}) * {HOUR!r}, count(*) FROM {part.name} GROUP BY 1"))}
    rolled = {float(h): int(n) for h, n in conn.execute(
        select(Rollup.hour, func.sum(Rollup.samples)).where(Rollup.scope == scope, Rollup.hour >= part.lo,
                                                             Rollup.hour < part.hi).group_by(Rollup.hour))}
    if any(rolled.get(h) != n for h, n in raw.items()):
        return None
    return sum(raw.values())


def _retain(store: Store, model, subject_col, scope: str, cutoff: float, passed: float,
            to_subject) -> tuple[int, int, int]:
    """(rows deleted, (subject, hour) pairs kept, rows deleted that no rollup counted) before `cutoff`; `passed`:
    the hours before it the rollup has passed."""
    hour = _hour_expr(store, model.ts).label("hour")
    with store.session() as session:
        raw = session.execute(
            select(hour, subject_col, func.count()).where(model.ts < cutoff).group_by(hour, subject_col)
        ).all()
        if not raw:
            return 0, 0, 0
        rolled = {
            (float(h), s): n
            for h, s, n in session.execute(
                select(Rollup.hour, Rollup.subject, Rollup.samples).where(Rollup.scope == scope, Rollup.hour < cutoff)
            )
        }
        deletable: dict[float, list] = {}
        counted: dict[tuple[float, object], int] = {}
        late: dict[float, list] = {}
        kept = 0
        for h, subject, n in raw:
            if rolled.get((float(h), str(subject))) == n:
                deletable.setdefault(float(h), []).append(to_subject(subject))
                counted[(float(h), to_subject(subject))] = n
            elif float(h) < passed:
                late.setdefault(float(h), []).append(to_subject(subject))
            else:
                kept += 1
        deleted = late_deleted = 0
        for h, subjects in deletable.items():
            for i in range(0, len(subjects), 500):
                chunk = subjects[i:i + 500]
                result = session.execute(
                    delete(model).where(model.ts >= h, model.ts < h + HOUR, subject_col.in_(chunk))
                )
                if result.rowcount != sum(counted[(h, subject)] for subject in chunk):
                    # a late sample of the hour came after it was counted: it was never rolled up, so nothing of
                    # this table goes this time (the next run counts again)
                    session.rollback()
                    log.warning("retention of %s: samples of hour %.0f arrived while it ran; nothing deleted, the "
                                "next run tries again", model.__tablename__, h)
                    return 0, len(raw), 0
                deleted += result.rowcount
        # every row of such an hour goes, one that came while this ran too: no rollup would take it either
        for h, subjects in late.items():
            for i in range(0, len(subjects), 500):
                late_deleted += session.execute(delete(model).where(
                    model.ts >= h, model.ts < h + HOUR, subject_col.in_(subjects[i:i + 500]))).rowcount
    return deleted + late_deleted, kept, late_deleted
