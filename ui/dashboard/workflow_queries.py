"""The dashboard's read-only queries of one workflow: its devices, its telemetry series (its own processes'
utilisation beside its devices'), step times, traces and profile requests."""

from __future__ import annotations

import math
from typing import Any

import pandas as pd
from sqlalchemy import func, select

from store.db import Store
from store.models import (
    Device,
    DeviceSample,
    ProcessSample,
    ProfileRequest,
    Rollup,
    StepStat,
    Trace,
    Workflow,
)
from store.models_slurm import SlurmJob
from ui.dashboard.queries import HOUR, Window, _bucket, _frame


def workflows(store: Store) -> pd.DataFrame:
    stmt = select(
        Workflow.id, Workflow.name, Workflow.team, Workflow.owner, Workflow.state, Workflow.managed,
        Workflow.last_seen,
    ).order_by(Workflow.last_seen.desc())
    return _frame(store, stmt)


def workflow(store: Store, workflow_id: str) -> dict[str, Any] | None:
    with store.session() as session:
        row = session.get(Workflow, workflow_id)
        if row is None:
            return None
        return {c.name: getattr(row, c.name) for c in Workflow.__table__.columns}


def workflow_devices(store: Store, workflow_id: str, window: Window) -> pd.DataFrame:
    """The devices the workflow's processes were seen on in the window, with their memory."""
    used = (
        select(ProcessSample.device_id)
        .where(ProcessSample.workflow_id == workflow_id, ProcessSample.ts >= window.start,
               ProcessSample.ts < window.end)
        .distinct()
        .subquery()
    )
    stmt = select(Device.id.label("device_id"), Device.host_id, Device.name, Device.memory_total).join(
        used, used.c.device_id == Device.id
    )
    return _frame(store, stmt)


def workflow_series(store: Store, workflow_id: str, window: Window) -> pd.DataFrame:
    """Per time bucket: utilisation and SM activity of its devices, its memory, and its devices' memory.

    Columns t, util (its devices', the context), own_util (its own processes': what the detectors judge it by; raw
    samples only), sm_active, mem_used (its processes' memory on its fullest device), mem_total (that device's
    memory), source (rollup | raw). A long window reads the hourly rollups; the hours after the last rolled-up one
    (the current, unfinished hour, and any not rolled up yet) come from raw samples, an hour a row. A workflow seen
    for only a short part of the window (minutes in an hour or a day) is read at sample resolution over the time it
    was seen, so its chart is a line, not one dot.
    """
    span = _sample_span(store, workflow_id, window)
    if span is not None and span[1] - span[0] < SHORT_SPAN_BUCKETS * window.bucket_s:
        first, last = span
        return _raw_series(store, workflow_id, first, last + 1, max(1, int((last - first) // 120)))
    if not window.uses_rollups:
        return _raw_series(store, workflow_id, window.start, window.end, window.bucket_s)
    stmt = (
        select(
            Rollup.hour.label("t"),
            Rollup.util_mean.label("util"),
            Rollup.sm_active_mean.label("sm_active"),
            Rollup.mem_peak.label("mem_used"),
            Rollup.mem_total.label("mem_total"),
        )
        .where(Rollup.scope == "workflow", Rollup.subject == workflow_id,
               Rollup.hour >= window.start, Rollup.hour < window.end)
        .order_by(Rollup.hour)
    )
    rolled = _frame(store, stmt).assign(source="rollup")
    covered = float(rolled["t"].max()) + HOUR if not rolled.empty else math.floor(window.start / HOUR) * HOUR
    raw_start = max(window.start, covered)
    if raw_start >= window.end:
        return rolled
    raw = _raw_series(store, workflow_id, raw_start, window.end, int(HOUR))
    if rolled.empty or raw.empty:
        return raw if rolled.empty else rolled
    return pd.concat([rolled, raw], ignore_index=True).sort_values("t").reset_index(drop=True)


SHORT_SPAN_BUCKETS = 2  # a workflow seen for less than two chart buckets is drawn at sample resolution


def _sample_span(store: Store, workflow_id: str, window: Window) -> tuple[float, float] | None:
    """(first, last) time its processes were sampled in the window (its rolled-up hours included), or None: never
    sampled, or its first rolled-up hour's raw samples are gone (retention), so only the rollups can show it."""
    ps = ProcessSample
    with store.session() as session:
        first, last = session.execute(select(func.min(ps.ts), func.max(ps.ts)).where(
            ps.workflow_id == workflow_id, ps.ts >= window.start, ps.ts < window.end)).one()
        hour = session.scalar(select(func.min(Rollup.hour)).where(
            Rollup.scope == "workflow", Rollup.subject == workflow_id, Rollup.hour >= window.start,
            Rollup.hour < window.end))
    if hour is not None:
        if first is None or float(first) >= float(hour) + HOUR:
            return None
        first = min(float(hour), float(first))
        last = max(float(last), float(hour) + HOUR)
    return None if first is None else (float(first), float(last))


def _raw_series(store: Store, workflow_id: str, start: float, end: float, bucket_s: int) -> pd.DataFrame:
    """workflow_series over [start, end) from raw samples, in buckets of bucket_s seconds."""
    b = bucket_s
    devices = workflow_devices(store, workflow_id, Window(start, end))
    if devices.empty:
        return pd.DataFrame(columns=["t", "util", "own_util", "sm_active", "mem_used", "mem_total", "source"])
    ds = DeviceSample
    dbucket = _bucket(store, ds.ts, b).label("t")
    dev = _frame(store, (
        select(dbucket, func.avg(ds.gpu_util).label("util"), func.avg(ds.sm_active).label("sm_active"))
        .where(ds.device_id.in_([int(d) for d in devices.device_id]), ds.ts >= start, ds.ts < end)
        .group_by(dbucket)
    ))
    ps = ProcessSample
    # as the analyzer's rollups: the memory its processes hold on one device (the fullest one), against that
    # device's memory
    per_ts = (
        select(ps.ts, func.sum(ps.mem_used).label("mem"))
        .where(ps.workflow_id == workflow_id, ps.ts >= start, ps.ts < end)
        .group_by(ps.ts, ps.device_id)
        .subquery()
    )
    pbucket = _bucket(store, per_ts.c.ts, b).label("t")
    mem = _frame(store, select(pbucket, func.max(per_ts.c.mem).label("mem_used")).group_by(pbucket))
    # its own processes' utilisation (GPU SM, else the cpu source's share of the device's cores), as the detectors
    # judge it: on a shared device the device's utilisation is its lane-mates' too
    obucket = _bucket(store, ps.ts, b).label("t")
    own = _frame(store, select(obucket, func.avg(func.coalesce(ps.sm_util, ps.cpu_util)).label("own_util"))
                 .where(ps.workflow_id == workflow_id, ps.ts >= start, ps.ts < end).group_by(obucket))
    df = dev.merge(mem, on="t", how="outer").merge(own, on="t", how="outer").sort_values("t")
    df["mem_total"] = float(devices.memory_total.max()) if devices.memory_total.notna().any() else None
    df["source"] = "raw"
    return df.reset_index(drop=True)


def workflow_steps(store: Store, workflow_id: str, window: Window) -> pd.DataFrame:
    s = StepStat
    stmt = (
        select(s.ts_end.label("t"), s.rank, s.first_step, s.last_step, s.n_steps, s.mean_s, s.p50_s, s.p95_s,
               s.max_s)
        .where(s.workflow_id == workflow_id, s.ts_end >= window.start, s.ts_end < window.end)
        .order_by(s.ts_end)
    )
    return _frame(store, stmt)


def workflow_traces(store: Store, workflow_id: str, limit: int = 20) -> pd.DataFrame:
    t = Trace
    stmt = (
        select(t.id, t.created_at, t.rank, t.host_id, t.path, t.steps, t.status, t.error, t.analyzed_at, t.summary,
               t.profile_request_id)
        .where(t.workflow_id == workflow_id)
        .order_by(t.created_at.desc())
        .limit(limit)
    )
    return _frame(store, stmt)


def profile_requests(store: Store, workflow_id: str, limit: int = 10) -> pd.DataFrame:
    p = ProfileRequest
    stmt = (
        select(p.id, p.steps, p.reason, p.requested_by, p.requested_at, p.status, p.claimed_at, p.completed_at,
               p.error)
        .where(p.workflow_id == workflow_id)
        .order_by(p.requested_at.desc(), p.id.desc())
        .limit(limit)
    )
    return _frame(store, stmt)


def slurm_jobs(store: Store) -> pd.DataFrame:
    """The Slurm jobs the last import saw (collector.importers.slurm), newest first, with what they hold on every
    node and whether they opted in to be moved; jobs squeue no longer lists are left out. `nodes` and `gpus_held` say
    what a job holds, for people: see _nodes_text and _gpus_held_text."""
    stmt = select(
        SlurmJob.workflow_id, SlurmJob.job_id, SlurmJob.name, SlurmJob.user, Workflow.team, SlurmJob.partition,
        SlurmJob.state, SlurmJob.reason, SlurmJob.node, SlurmJob.gres, SlurmJob.gpus, SlurmJob.shards,
        SlurmJob.gpu_indices, SlurmJob.gpus_by_node, SlurmJob.time_limit_s, SlurmJob.restart_count,
        SlurmJob.opted_in, SlurmJob.not_movable_reason, SlurmJob.seen_at,
    ).join(Workflow, Workflow.id == SlurmJob.workflow_id).where(SlurmJob.state != "GONE").order_by(
        SlurmJob.job_id.desc())
    frame = _frame(store, stmt)
    if not frame.empty:
        frame["nodes"] = [_nodes_text(b, n) for b, n in zip(frame.gpus_by_node, frame.node, strict=True)]
        frame["gpus_held"] = [_gpus_held_text(b) for b in frame.gpus_by_node]
    return frame


def slurm_job(store: Store, workflow_id: str) -> dict[str, Any] | None:
    """What Slurm last said of the workflow's job (with `nodes` and `gpus_held` as slurm_jobs has them), or None
    when it is not a Slurm job."""
    with store.session() as session:
        row = session.get(SlurmJob, workflow_id)
        if row is None:
            return None
        job = {c.name: getattr(row, c.name) for c in SlurmJob.__table__.columns}
    return {**job, "nodes": _nodes_text(job["gpus_by_node"], job["node"]), "gpus_held": _gpus_held_text(
        job["gpus_by_node"])}


NODES_NAMED = 3  # a job on more nodes is shown by the first ones and its count


def _nodes_text(by_node: list[Any] | None, node: str | None) -> str | None:
    """The nodes a job holds GPUs on ("gpu01, gpu02"; "gpu01, gpu02, gpu03, … (8 nodes)"), else its batch node
    (a job holding no GPU), None for a job on no node yet."""
    names = [str(n) for n, _ in by_node or []]
    if not names:
        return node
    if len(names) <= NODES_NAMED:
        return ", ".join(names)
    return f"{', '.join(names[:NODES_NAMED])}, … ({len(names)} nodes)"


def _gpus_held_text(by_node: list[Any] | None) -> str:
    """A job's GPU indices: "0,1" on one node, as Slurm's IDX lists them; "gpu01: 0,1; gpu02: 2,3" on several."""
    held = [(str(n), ",".join(str(i) for i in ix)) for n, ix in by_node or []]
    if len(held) == 1:
        return held[0][1]
    return "; ".join(f"{n}: {ix}" for n, ix in held)
