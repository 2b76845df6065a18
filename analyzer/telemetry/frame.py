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
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pandas as pd
from sqlalchemy import distinct, func, select

from analyzer.telemetry.thresholds import Common
from store.db import Store
from store.models import Device, DeviceSample, ProcessSample, Workflow

DEFAULT_INTERVAL_S = 60.0


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
    # results the detectors share (e.g. per workflow-device statistics), computed once per window
    cache: dict[str, Any] = field(default_factory=dict)

    @property
    def span_s(self) -> float:
        """The time the window's samples cover (first sample to the end of the last one)."""
        if "span_s" not in self.cache:
            s = self.samples
            self.cache["span_s"] = 0.0 if s.empty else float((s["ts"] + s["dt"]).max() - s["ts"].min())
        return self.cache["span_s"]

    def per_day(self, gpu_seconds: float) -> float:
        """GPU-seconds seen in this window as GPU-hours per day at the same rate."""
        span = self.span_s
        return 0.0 if span <= 0 else gpu_seconds / span * 24.0

    def device_label(self, device_id: int) -> str:
        if "labels" not in self.cache:
            d = self.devices
            self.cache["labels"] = {
                int(i): f"device {i} ({h}:{x}, {n})" for i, h, x, n in zip(d.index, d["host_id"], d["index"], d["name"],
                                                                          strict=True)
            }
        return self.cache["labels"].get(int(device_id), f"device {device_id}")

    def device_short(self, device_id: int) -> str:
        """host:index of the device, for titles."""
        if device_id in self.devices.index:
            d = self.devices.loc[device_id]
            return f"{d['host_id']}:{d['index']}"
        return f"device {device_id}"

    def device_total(self, device_id: int) -> float | None:
        if device_id in self.devices.index:
            total = self.devices.loc[device_id, "memory_total"]
            return None if pd.isna(total) else float(total)
        return None


def fmt_ts(ts: float) -> str:
    return datetime.fromtimestamp(float(ts), UTC).strftime("%Y-%m-%d %H:%M")


def fmt_window(start: float, end: float) -> str:
    return f"{fmt_ts(start)} to {fmt_ts(end)} UTC"


def _read(store: Store, query) -> pd.DataFrame:
    with store.engine.connect() as conn:
        return pd.read_sql_query(query, conn)


def _device_filter(devices: Sequence[int] | None) -> str:
    """The SQL condition keeping only these devices' rows (ints only are inlined), or nothing."""
    return "" if devices is None else f" AND device_id IN ({', '.join(str(int(d)) for d in devices) or 'NULL'})"


def _read_window(store: Store, table: str, columns: tuple[str, ...], start: float, end: float,
                 devices: Sequence[int] | None = None) -> pd.DataFrame:
    """Rows of [start, end) of a sample table, fetched past the ORM: a day of a fleet is millions of rows.

    PostgreSQL streams them with COPY ... TO STDOUT as CSV; SQLite hands over tuples from its own cursor.
    """
    cols = ", ".join(columns)
    if not store.is_postgres:
        return _fetch(store, f"SELECT {cols} FROM {table} WHERE {{where}}", table, start, end, columns, devices)
    # floats only are inlined, nothing user-written
    where = f"ts >= {float(start)!r} AND ts < {float(end)!r}" + _device_filter(devices)
    dtypes = _dtypes(columns)
    with store.engine.connect() as conn:
        cursor = conn.connection.driver_connection.cursor()
        try:
            buf = io.BytesIO()
            with cursor.copy(f"COPY (SELECT {cols} FROM {table} WHERE {where}) TO STDOUT WITH (FORMAT csv)") as cp:
                for block in cp:
                    buf.write(block)
        finally:
            cursor.close()
    buf.seek(0)
    if not buf.getbuffer().nbytes:
        return _empty(dtypes)
    return pd.read_csv(buf, names=list(columns), header=None, dtype=dtypes, keep_default_na=False,
                       na_values={c: [""] for c in columns if dtypes[c] == "float64"})


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
    from the driver's own cursor, past the ORM."""
    dtypes = _dtypes(columns)
    with store.engine.connect() as conn:
        cursor = conn.connection.driver_connection.cursor()
        try:
            where = (f"ts >= {float(start)!r} AND ts < {float(end)!r}" if store.is_postgres
                     else _sqlite_where(cursor, table, start, end)) + _device_filter(devices)
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


def load_window(store: Store, start: float, end: float, common: Common,
                devices: Sequence[int] | None = None) -> TelemetryWindow:
    """Read device and process samples of [start, end) and attribute each device sample to workflows; with
    `devices`, only those devices' samples (a chunk of the fleet, see analyzer.telemetry.chunks)."""
    bucket_s = common.bucket_s
    interval = _mean_interval(store, start, end, probe_s=4 * bucket_s) if bucket_s > 0 else None
    if interval is not None and interval < bucket_s / 2:
        samples = _read_bucketed_devices(store, start, end, bucket_s, devices)
        procs = _read_bucketed_processes(store, start, end, bucket_s, devices)
    else:
        samples, procs = _read_raw(store, start, end, devices)
    devices = _read(store, select(Device.id.label("device_id"), Device.host_id, Device.index, Device.name,
                                  Device.memory_total)).set_index("device_id")
    workflows = _read(store, select(Workflow.id.label("workflow_id"), Workflow.team, Workflow.gpus)).set_index(
        "workflow_id"
    )

    samples["device_id"] = samples["device_id"].astype("int64")
    samples = samples.sort_values(["device_id", "ts"], kind="stable").reset_index(drop=True)
    # a sample without its own mem_total takes the device's registered one
    if not samples.empty:
        samples["mem_total"] = samples["mem_total"].fillna(samples["device_id"].map(devices["memory_total"]))
    samples["dt"] = _sample_intervals(samples, common.max_gap_factor) if not samples.empty else pd.Series(
        dtype="float64")

    usage = _attribute(procs, samples)
    n = usage.groupby(["device_id", "ts"], sort=False).size().rename("n_workflows")
    samples = samples.merge(n, left_on=["device_id", "ts"], right_index=True, how="left")
    samples["n_workflows"] = samples["n_workflows"].fillna(0).astype("int64")
    usage = usage.merge(n, left_on=["device_id", "ts"], right_index=True, how="left")
    usage["share"] = 1.0 / usage["n_workflows"]
    # a workflow alone on a device whose source has no per-process memory holds the device's memory
    alone = usage["wf_mem"].isna() & (usage["n_workflows"] == 1)
    usage.loc[alone, "wf_mem"] = usage.loc[alone, "mem_used"]
    usage["held"] = usage["wf_mem"].isna() | (usage["wf_mem"] >= common.held_min_bytes)
    # the device is held when a workflow on it holds it, or, with nobody on it, when its memory is in use
    holding = usage[usage["held"]].groupby(["device_id", "ts"], sort=False).size()
    samples = samples.merge(holding.rename("n_holding"), left_on=["device_id", "ts"], right_index=True, how="left")
    samples["held"] = samples["n_holding"].notna() | (
        (samples["n_workflows"] == 0) & (samples["mem_used"].fillna(0) >= common.held_min_bytes)
    )
    samples = samples.drop(columns="n_holding")
    return TelemetryWindow(
        start=start, end=end, samples=samples, usage=usage,
        processes=procs[["workflow_id", "device_id", "ts", "n_raw"]], devices=devices, workflows=workflows, store=store,
    )


def _read_raw(store: Store, start: float, end: float,
              devices: Sequence[int] | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(device samples, per-workflow process samples) of [start, end), every sample as recorded."""
    samples = _read_window(
        store, DeviceSample.__tablename__, ("device_id", "ts", "gpu_util", "mem_used", "mem_total", "sm_active"),
        start, end, devices,
    )
    samples["n_raw"] = 1.0
    raw = _read_window(
        store, ProcessSample.__tablename__, ("workflow_id", "device_id", "ts", "mem_used", "sm_util", "cpu_util"),
        start, end, devices,
    )
    # A process's own utilisation (NVML's per-process SM share, or the cpu source's share of the device's cores)
    # says what the workflow does on a shared device; the device's reading mixes in its neighbours.
    raw["own_util"] = raw["sm_util"].astype("float64").fillna(raw["cpu_util"].astype("float64"))
    # several processes of one workflow on one device count together
    g = raw.groupby(["workflow_id", "device_id", "ts"], sort=False)
    procs = pd.DataFrame(
        {"wf_mem": g["mem_used"].sum(min_count=1), "sm_util": g["sm_util"].max(),
         "own_util": g["own_util"].sum(min_count=1).clip(upper=1.0), "n_raw": g.size()}
    ).reset_index()
    return samples, procs


def _attribute(procs: pd.DataFrame, samples: pd.DataFrame) -> pd.DataFrame:
    """Join each workflow's process sample to the nearest device sample of the same device."""
    cols = ["workflow_id", "device_id", "ts", "wf_mem", "sm_util", "own_util", "n_raw",
            "gpu_util", "device_util", "mem_used", "mem_total", "sm_active", "dt"]
    if procs.empty or samples.empty:
        return pd.DataFrame({c: pd.Series(dtype="object" if c == "workflow_id" else "float64") for c in cols})
    procs = procs.astype({"device_id": "int64", "ts": "float64", "wf_mem": "float64", "sm_util": "float64",
                          "own_util": "float64"})
    procs = procs.sort_values("ts", kind="stable")
    right = samples[["device_id", "ts", "dt"]].rename(columns={"ts": "dev_ts"}).sort_values("dev_ts", kind="stable")
    tolerance = float(np.nanmedian(samples["dt"])) / 2 if samples["dt"].notna().any() else DEFAULT_INTERVAL_S / 2
    joined = pd.merge_asof(
        procs, right.drop(columns="dt"), left_on="ts", right_on="dev_ts", by="device_id",
        direction="nearest", tolerance=max(tolerance, 1e-6),
    )
    joined = joined.dropna(subset=["dev_ts"])
    # two process samples that land on one device sample: one row, the larger memory
    joined = (
        joined.groupby(["workflow_id", "device_id", "dev_ts"], sort=False)
        .agg(wf_mem=("wf_mem", "max"), sm_util=("sm_util", "max"), own_util=("own_util", "max"),
             n_raw=("n_raw", "sum"))
        .reset_index()
        .rename(columns={"dev_ts": "ts"})
    )
    joined = joined.merge(samples[["device_id", "ts", "gpu_util", "mem_used", "mem_total", "sm_active", "dt"]],
                          on=["device_id", "ts"], how="left")
    # the workflow's utilisation: its processes' own where recorded, else the device's
    joined["device_util"] = joined["gpu_util"]
    joined["gpu_util"] = joined["own_util"].where(joined["own_util"].notna(), joined["gpu_util"])
    return joined.sort_values(["workflow_id", "device_id", "ts"], kind="stable").reset_index(drop=True)
