"""One bounded time window of telemetry as pandas frames, with each device sample attributed to workflows.

Attribution: a device sample belongs to the workflows that have a process sample on that device at
that time (the nearest process sample within half the device's sampling interval). Each such
(workflow, device, sample) row is one row of `usage`. A sample stands for the time `dt` up to the next
sample of the device, capped at `max_gap_factor` times the device's median interval, so a hole in the
data is never counted as held or idle time. When several workflows share a device at one sample,
each gets `share = 1 / n_workflows` of it (the GPU-time it costs is split, not multiplied).

A workflow *holds* the device at a sample when its processes there use at least `held_min_gib` of
memory, or when the source reports no per-process memory at all (a process with a context on a GPU
always holds some).

Agents sample every second; a day of a thousand devices is then 86 M rows. When the window's samples come
faster than one per `bucket_s`, the database averages them into buckets of `bucket_s` per device (and per
workflow and device) before anything is fetched: utilisation and SM activity are bucket means, memory the
bucket's peak, the bucket's time that of its first sample (see _read_bucketed_processes for a workflow with
several processes on one device). Data already as coarse as a bucket is read raw.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
from pyarrow import csv as pa_csv
from sqlalchemy import distinct, func, select, text

from analyzer.telemetry.thresholds import Common
from store.db import Store
from store.models import Device, DeviceSample, ProcessSample, Workflow

DEFAULT_INTERVAL_S = 60.0
SLICE_S = 3600.0  # the read plan decides buckets or raw samples slice by slice
PROBE_ROWS, PROBE_DEVICES = 256, 16
ReadPlan = list[tuple[float, float, bool]]  # (lo, hi, bucketed) ranges, see read_plan
TEXT_PARTS = 64  # strings a PostgreSQL read is fetched in (see _csv_frame)


@dataclass
class TelemetryWindow:
    """Samples of [start, end) ready for the detectors and the rollups."""

    start: float
    end: float
    # device_id, ts, gpu_util, mem_used, mem_total, sm_active, n_raw (samples recorded: 1, or a bucket's count),
    # dt (seconds this sample stands for), n_workflows (workflows attributed to this sample), held (see module doc)
    samples: pd.DataFrame
    # workflow_id, device_id, ts, wf_mem, sm_util, n_raw (process sample rows), plus the device
    # sample's gpu_util, mem_used, mem_total, sm_active, dt, n_workflows, share, held
    usage: pd.DataFrame
    # workflow_id, device_id, ts, n_raw: every process sample row of the window, attributed or not
    processes: pd.DataFrame
    # device_id -> host_id, index, name, memory_total
    devices: pd.DataFrame
    # workflow_id -> team, gpus
    workflows: pd.DataFrame
    # the store the window came from, for detectors that look up more (e.g. when processes ended)
    store: Store | None = None


def fmt_ts(ts: float) -> str:
    return datetime.fromtimestamp(float(ts), UTC).strftime("%Y-%m-%d %H:%M")


def fmt_window(start: float, end: float) -> str:
    return f"{fmt_ts(start)} to {fmt_ts(end)} UTC"


def _read(store: Store, query) -> pd.DataFrame:
    with store.engine.connect() as conn:
        return pd.read_sql_query(query, conn)


def _device_filter(devices: Sequence[int] | None) -> str:
    """The SQL condition keeping only these devices' rows (ints only are inlined), or nothing. The id range beside
    the list lets the database read a group of devices through the (device_id, ts) index."""
    if devices is None:
        return ""
    ids = [int(d) for d in devices]
    if not ids:
        return " AND device_id IN (NULL)"
    return f" AND device_id BETWEEN {min(ids)} AND {max(ids)} AND device_id IN ({', '.join(map(str, ids))})"


def _read_window(store: Store, table: str, columns: tuple[str, ...], start: float, end: float,
                 devices: Sequence[int] | None = None) -> pd.DataFrame:
    """Rows of [start, end) of a sample table, fetched past the ORM: a day of a fleet is millions of rows."""
    cols = ", ".join(columns)
    return _fetch(store, f"SELECT {cols} FROM {table} WHERE {{where}}", table, start, end, columns, devices)


def _csv_frame(store: Store, sql: str, columns: tuple[str, ...]) -> pd.DataFrame:
    """The rows of a PostgreSQL query (it has a device_id column) as a frame: the database writes them as CSV text,
    in TEXT_PARTS strings (devices spread over them by id), and pyarrow parses it in C. A day of a fleet is millions
    of rows; fetched as tuples or by COPY (one protocol message, so one Python call, per row) the client's per-row
    work is most of the time. A few large strings rather than one per device: the database's aggregation costs
    per group (an hour of 10,000 devices: 2.2 s in 10,000 strings, 1.3 s in 100), and many keep each string far
    below PostgreSQL's 1 GB limit for a text value."""
    dtypes = _dtypes(columns)
    fields = ", ".join(
        # text quoted as CSV wants it; a NULL number is an empty field
        f"""'"' || replace({c}::text, '"', '""') || '"'""" if dtypes[c] == "str" else f"coalesce({c}::text, '')"
        for c in columns)
    with store.engine.connect() as conn:
        cursor = conn.connection.driver_connection.cursor()
        try:
            # the strings are built in memory rather than spilled to disk
            cursor.execute("SET LOCAL work_mem = '256MB'")
            cursor.execute(f"SELECT string_agg(concat_ws(',', {fields}), E'\\n') FROM ({sql}) AS q "
                           f"GROUP BY device_id % {TEXT_PARTS}")
            parts = [row[0] for row in cursor.fetchall()]
        finally:
            cursor.close()
    if not parts:
        return _empty(dtypes)
    types = {c: (pa.string() if t == "str" else pa.float64()) for c, t in dtypes.items()}
    table = pa_csv.read_csv(io.BytesIO("\n".join(parts).encode()),
                            read_options=pa_csv.ReadOptions(column_names=list(columns)),
                            parse_options=pa_csv.ParseOptions(newlines_in_values=True),
                            convert_options=pa_csv.ConvertOptions(column_types=types, strings_can_be_null=False))
    return table.to_pandas().astype(dtypes)


def _mean_interval(store: Store, start: float, end: float, probe_s: float) -> float | None:
    """The mean time between two samples of one device over the last `probe_s` of the window (None: no data)."""
    lo = max(start, end - probe_s)
    ts = DeviceSample.ts
    with store.session() as session:
        rows, devices, first, last = session.execute(
            select(func.count(), func.count(distinct(DeviceSample.device_id)), func.min(ts), func.max(ts))
            .where(ts >= lo, ts < end)
        ).one()
    if not rows or not devices:
        return None
    per_device = rows / devices
    return (float(last) - float(first)) / (per_device - 1) if per_device > 1 else float(end - lo)


def read_plan(store: Store, start: float, end: float, common: Common) -> ReadPlan:
    """How [start, end) is read: ranges (lo, hi, bucketed), each read as recorded or in buckets.

    Each slice of about an hour (whole buckets) is read in buckets when its samples come faster than one per half
    bucket, as recorded otherwise: the database's bucket aggregation costs many times a plain read, so data already
    as coarse as a bucket (a fleet's older minutes) is not aggregated again beside the last hour's 1 Hz samples. The
    rate is probed on a few devices seen last (one indexed query); a slice they have no samples in reads as its
    neighbour does."""
    bucket_s = common.bucket_s
    if bucket_s <= 0:
        return [(start, end, False)]
    interval = _mean_interval(store, start, end, probe_s=4 * bucket_s)
    if interval is None:
        return [(start, end, False)]
    slice_s = bucket_s * max(1, round(SLICE_S / bucket_s))
    ts = DeviceSample.ts
    with store.session() as session:
        last = session.scalars(select(DeviceSample.device_id).where(ts >= start, ts < end).order_by(ts.desc())
                               .limit(PROBE_ROWS))
        probe = list(dict.fromkeys(int(d) for d in last))[:PROBE_DEVICES]
        rows = session.execute(text(
            f"SELECT {_bucket_sql(store, slice_s)} AS s, count(*), count(DISTINCT device_id), min(ts), max(ts) "
            f"FROM device_samples WHERE ts >= {float(start)!r} AND ts < {float(end)!r}"
            f"{_device_filter(probe)} GROUP BY 1")).all()
    fast: dict[int, bool] = {}
    for k, n, n_devices, first, last_ts in rows:
        per_device = n / n_devices
        lo, hi = max(start, int(k) * slice_s), min(end, (int(k) + 1) * slice_s)
        mean = (float(last_ts) - float(first)) / (per_device - 1) if per_device > 1 else hi - lo
        fast[int(k)] = mean < bucket_s / 2
    first_k, last_k = int(start // slice_s), int(math.ceil(end / slice_s)) - 1
    plan: ReadPlan = []
    decided = interval < bucket_s / 2  # the window's own probe decides slices the probe devices are absent from
    for k in range(last_k, first_k - 1, -1):  # from the end: an undecided slice reads as the later one
        decided = fast.get(k, decided)
        lo, hi = max(start, k * slice_s), min(end, (k + 1) * slice_s)
        if plan and plan[0][2] == decided:
            plan[0] = (lo, plan[0][1], decided)
        else:
            plan.insert(0, (lo, hi, decided))
    return plan


def _concat(frames: list[pd.DataFrame]) -> pd.DataFrame:
    frames = [f for f in frames if not f.empty] or frames[:1]
    return frames[0] if len(frames) == 1 else pd.concat(frames, ignore_index=True)


def _bucket_sql(store: Store, bucket_s: float) -> str:
    b = float(bucket_s)
    return f"floor(ts / {b!r})" if store.is_postgres else f"CAST(ts / {b!r} AS INTEGER)"


def _read_bucketed_devices(store: Store, start: float, end: float, bucket_s: float,
                           devices: Sequence[int] | None = None) -> pd.DataFrame:
    """Device samples of [start, end) averaged per device and bucket, in the database."""
    bucket = _bucket_sql(store, bucket_s)
    sql = (f"SELECT device_id, min(ts) AS ts, avg(gpu_util) AS gpu_util, max(mem_used) AS mem_used, "
           f"max(mem_total) AS mem_total, avg(sm_active) AS sm_active, count(*) AS n_raw FROM device_samples "
           f"WHERE {{where}} GROUP BY device_id, {bucket}")
    return _fetch(store, sql, "device_samples", start, end,
                  ("device_id", "ts", "gpu_util", "mem_used", "mem_total", "sm_active", "n_raw"), devices)


def _read_bucketed_processes(store: Store, start: float, end: float, bucket_s: float,
                             devices: Sequence[int] | None = None) -> pd.DataFrame:
    """Process samples of [start, end) per workflow, device and bucket, aggregated in the database in one pass
    (columns as load_window's `procs`). A workflow's processes on one device count together: its utilisation is
    their per-sample sum averaged over the bucket (at most 1), its memory the largest process's peak times the
    processes seen, an upper bound of their peak sum, exact for the usual one process per device."""
    bucket = _bucket_sql(store, bucket_s)
    own = "sum(coalesce(sm_util, cpu_util)) / count(DISTINCT ts)"
    sql = (f"SELECT workflow_id, device_id, min(ts) AS ts, max(mem_used) * count(DISTINCT pid) AS wf_mem, "
           f"avg(sm_util) AS sm_util, CASE WHEN {own} > 1.0 THEN 1.0 ELSE {own} END AS own_util, count(*) AS n_raw "
           f"FROM process_samples WHERE {{where}} GROUP BY workflow_id, device_id, {bucket}")
    return _fetch(store, sql, "process_samples", start, end,
                  ("workflow_id", "device_id", "ts", "wf_mem", "sm_util", "own_util", "n_raw"), devices)


def _fetch(store: Store, sql: str, table: str, start: float, end: float, columns: tuple[str, ...],
           devices: Sequence[int] | None = None) -> pd.DataFrame:
    """The rows of `sql`, a query over `table`'s [start, end) (its `{where}`), as a frame of `columns`; fetched
    past the ORM (PostgreSQL: CSV text built by the database, see _csv_frame; SQLite: its own cursor's tuples)."""
    if store.is_postgres:
        where = f"ts >= {float(start)!r} AND ts < {float(end)!r}" + _device_filter(devices)
        return _csv_frame(store, sql.format(where=where), columns)
    dtypes = _dtypes(columns)
    with store.engine.connect() as conn:
        cursor = conn.connection.driver_connection.cursor()
        try:
            where = _sqlite_where(cursor, table, start, end) + _device_filter(devices)
            cursor.execute(sql.format(where=where))
            rows = cursor.fetchall()
        finally:
            cursor.close()
    if not rows:
        return _empty(dtypes)
    if all(t == "float64" for t in dtypes.values()):
        # all numeric: numpy converts the tuples (None -> NaN) far faster than pandas' object path
        return pd.DataFrame(np.array(rows, dtype="float64"), columns=list(columns))
    return pd.DataFrame(rows, columns=list(columns)).astype(dtypes)


def _dtypes(columns: tuple[str, ...]) -> dict[str, str]:
    return {c: ("str" if c in ("workflow_id", "host_id") else "float64") for c in columns}


def _empty(dtypes: dict[str, str]) -> pd.DataFrame:
    return pd.DataFrame({c: pd.Series(dtype=t) for c, t in dtypes.items()})


def _sqlite_where(cursor: Any, table: str, start: float, end: float) -> str:
    """SQLite's filter for [start, end): through the ts index, unless the window is most of the table, when one
    sequential scan beats a lookup per row (`+ts` keeps the planner off the index)."""
    lo, hi = cursor.execute(f"SELECT min(ts), max(ts) FROM {table}").fetchone()
    scan = "+" if lo is not None and (min(end, hi) - max(start, lo)) > 0.5 * (hi - lo) else ""
    return f"{scan}ts >= {float(start)!r} AND {scan}ts < {float(end)!r}"


def _sample_intervals(samples: pd.DataFrame, max_gap_factor: float) -> pd.Series:
    """dt of each sample: the time to the device's next sample, capped; the last one gets the median."""
    nxt = samples.groupby("device_id", sort=False)["ts"].shift(-1)
    gap = nxt - samples["ts"]
    median = gap.groupby(samples["device_id"], sort=False).transform("median")
    fallback = float(gap.median()) if gap.notna().any() else DEFAULT_INTERVAL_S
    median = median.fillna(fallback)
    return gap.fillna(median).clip(upper=median * max_gap_factor).clip(lower=0.0)


def read_rows(store: Store, plan: ReadPlan, common: Common,
              devices: Sequence[int] | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(device samples, per-workflow process samples) of the plan's ranges, as load_window reads them."""
    def device_rows() -> pd.DataFrame:
        return _concat([_read_bucketed_devices(store, lo, hi, common.bucket_s, devices) if bucketed
                        else _read_raw_devices(store, lo, hi, devices) for lo, hi, bucketed in plan])

    def process_rows() -> pd.DataFrame:
        return _concat([_read_bucketed_processes(store, lo, hi, common.bucket_s, devices) if bucketed
                        else _read_raw_processes(store, lo, hi, devices) for lo, hi, bucketed in plan])

    if not store.is_postgres:
        return device_rows(), process_rows()
    # PostgreSQL builds each table's text in a backend of its own: the two tables are read at once
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="fleetlens-read-processes") as pool:
        procs = pool.submit(process_rows)
        samples = device_rows()
        return samples, procs.result()


def read_registry(store: Store) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(devices indexed by device_id: host_id, index, name, source, memory_total; workflows indexed by workflow_id:
    team, gpus)."""
    devices = _read(store, select(Device.id.label("device_id"), Device.host_id, Device.index, Device.name,
                                  Device.source, Device.memory_total)).set_index("device_id")
    workflows = _read(store, select(Workflow.id.label("workflow_id"), Workflow.team, Workflow.gpus)).set_index(
        "workflow_id"
    )
    return devices, workflows


def load_window(store: Store, start: float, end: float, common: Common,
                devices: Sequence[int] | None = None,
                rows: tuple[pd.DataFrame, pd.DataFrame] | None = None,
                registry: tuple[pd.DataFrame, pd.DataFrame] | None = None) -> TelemetryWindow:
    """Read device and process samples of [start, end) and attribute each device sample to workflows; with
    `devices`, only those devices' samples (a chunk of the fleet, see analyzer.telemetry.chunks); with `rows`,
    those already read by read_rows; with `registry`, the devices and workflows already read by read_registry (a
    reader of many groups reads them once)."""
    samples, procs = rows if rows is not None else read_rows(store, read_plan(store, start, end, common), common,
                                                             devices)
    devices, workflows = registry if registry is not None else read_registry(store)

    samples["device_id"] = samples["device_id"].astype("int64")
    samples = samples.sort_values(["device_id", "ts"], kind="stable").reset_index(drop=True)
    # a sample without its own mem_total takes the device's registered one
    if not samples.empty:
        samples["mem_total"] = samples["mem_total"].fillna(samples["device_id"].map(devices["memory_total"]))
    samples["dt"] = _sample_intervals(samples, common.max_gap_factor) if not samples.empty else pd.Series(
        dtype="float64")

    usage, at = _attribute(procs, samples)
    # per device sample: the workflows attributed to it, and whether one of them holds it (counted by position)
    n = np.bincount(at, minlength=len(samples)) if len(samples) else np.zeros(0, dtype="int64")
    samples["n_workflows"] = n.astype("int64")
    usage["n_workflows"] = n[at].astype("int64")
    usage["share"] = 1.0 / usage["n_workflows"]
    # a workflow alone on a device whose source has no per-process memory holds the device's memory
    alone = usage["wf_mem"].isna() & (usage["n_workflows"] == 1)
    usage.loc[alone, "wf_mem"] = usage.loc[alone, "mem_used"]
    usage["held"] = usage["wf_mem"].isna() | (usage["wf_mem"] >= common.held_min_bytes)
    # the device is held when a workflow on it holds it, or, with nobody on it, when its memory is in use
    holding = np.bincount(at[usage["held"].to_numpy()], minlength=len(samples)) > 0
    samples["held"] = holding | ((n == 0) & (samples["mem_used"].fillna(0) >= common.held_min_bytes).to_numpy())
    return TelemetryWindow(
        start=start, end=end, samples=samples, usage=usage,
        processes=procs[["workflow_id", "device_id", "ts", "n_raw"]], devices=devices, workflows=workflows, store=store,
    )


def _read_raw_devices(store: Store, start: float, end: float,
                      devices: Sequence[int] | None = None) -> pd.DataFrame:
    """Device samples of [start, end), every sample as recorded."""
    samples = _read_window(
        store, DeviceSample.__tablename__, ("device_id", "ts", "gpu_util", "mem_used", "mem_total", "sm_active"),
        start, end, devices,
    )
    samples["n_raw"] = 1.0
    return samples


def _read_raw_processes(store: Store, start: float, end: float,
                        devices: Sequence[int] | None = None) -> pd.DataFrame:
    """Per-workflow process samples of [start, end), every sample as recorded."""
    raw = _read_window(
        store, ProcessSample.__tablename__, ("workflow_id", "device_id", "ts", "mem_used", "sm_util", "cpu_util"),
        start, end, devices,
    )
    # A process's own utilisation (NVML's per-process SM share, or the cpu source's share of the device's cores)
    # says what the workflow does on a shared device; the device's reading mixes in its neighbours.
    raw["own_util"] = raw["sm_util"].astype("float64").fillna(raw["cpu_util"].astype("float64"))
    # several processes of one workflow on one device count together; a sample alone on its device and time (the
    # usual one process per device) is its own sum
    several = raw.duplicated(["device_id", "ts"], keep=False).to_numpy()
    alone = raw.loc[~several]
    procs = pd.DataFrame({"workflow_id": alone["workflow_id"], "device_id": alone["device_id"], "ts": alone["ts"],
                          "wf_mem": alone["mem_used"], "sm_util": alone["sm_util"],
                          "own_util": alone["own_util"].clip(upper=1.0), "n_raw": 1})
    if several.any():
        g = raw.loc[several].groupby(["workflow_id", "device_id", "ts"], sort=False)
        grouped = pd.DataFrame(
            {"wf_mem": g["mem_used"].sum(min_count=1), "sm_util": g["sm_util"].max(),
             "own_util": g["own_util"].sum(min_count=1).clip(upper=1.0), "n_raw": g.size()}
        ).reset_index()
        procs = pd.concat([procs, grouped], ignore_index=True)
    return procs.reset_index(drop=True)


def _attribute(procs: pd.DataFrame, samples: pd.DataFrame) -> tuple[pd.DataFrame, np.ndarray]:
    """Join each workflow's process sample to the nearest device sample of the same device: (usage, the position in
    `samples` of each usage row's device sample). `samples` is sorted by (device, ts) with a fresh index."""
    cols = ["workflow_id", "device_id", "ts", "wf_mem", "sm_util", "own_util", "n_raw",
            "gpu_util", "device_util", "mem_used", "mem_total", "sm_active", "dt"]
    if procs.empty or samples.empty:
        empty = pd.DataFrame({c: pd.Series(dtype="object" if c == "workflow_id" else "float64") for c in cols})
        return empty, np.zeros(0, dtype="int64")
    procs = procs.astype({"device_id": "int64", "ts": "float64", "wf_mem": "float64", "sm_util": "float64",
                          "own_util": "float64"})
    # a process sample taken with a device sample (what every agent writes) is matched on (device, time) by a hash
    # join; only the others look for the nearest device sample
    at = pd.DataFrame({"device_id": samples["device_id"], "ts": samples["ts"], "pos": np.arange(len(samples))})
    at = at.drop_duplicates(["device_id", "ts"])
    procs = procs.merge(at, on=["device_id", "ts"], how="left")
    hit = procs["pos"].notna().to_numpy()
    joined = procs.loc[hit]
    rest = procs.loc[~hit].drop(columns="pos")
    if not rest.empty:
        rest = rest.sort_values("ts", kind="stable")
        right = at.rename(columns={"ts": "dev_ts"}).sort_values("dev_ts", kind="stable")
        tolerance = float(np.nanmedian(samples["dt"])) / 2 if samples["dt"].notna().any() else DEFAULT_INTERVAL_S / 2
        near = pd.merge_asof(rest, right, left_on="ts", right_on="dev_ts", by="device_id", direction="nearest",
                             tolerance=max(tolerance, 1e-6))
        near = near.dropna(subset=["dev_ts"]).drop(columns="ts").rename(columns={"dev_ts": "ts"})
        # two process samples that land on one device sample: one row, the larger memory
        joined = (
            pd.concat([joined, near], ignore_index=True)
            .groupby(["workflow_id", "device_id", "ts", "pos"], sort=False)
            .agg(wf_mem=("wf_mem", "max"), sm_util=("sm_util", "max"), own_util=("own_util", "max"),
                 n_raw=("n_raw", "sum"))
            .reset_index()
        )
    # sorted by (workflow, device, ts); workflow ids sort as their codes (factorize sorts them as strings)
    codes, _ = pd.factorize(joined["workflow_id"], sort=True)
    order = np.lexsort((joined["ts"].to_numpy(), joined["device_id"].to_numpy(), codes))
    pos = joined["pos"].to_numpy().astype("int64")[order]
    # each column taken once, in order: the process's own, then its device sample's
    out = {c: joined[c].to_numpy()[order] for c in ("workflow_id", "device_id", "ts", "wf_mem", "sm_util", "own_util",
                                                     "n_raw")}
    for c in ("gpu_util", "mem_used", "mem_total", "sm_active", "dt"):
        out[c] = samples[c].to_numpy()[pos]
    # the workflow's utilisation: its processes' own where recorded, else the device's
    out["device_util"] = out["gpu_util"]
    out["gpu_util"] = np.where(np.isnan(out["own_util"]), out["device_util"], out["own_util"])
    return pd.DataFrame({c: out[c] for c in cols}), pos
