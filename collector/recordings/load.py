"""A whole recording written into a store at once: hosts, devices, workflows, processes and samples."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
from sqlalchemy import delete, select
from sqlalchemy.exc import IntegrityError

from collector.recordings.alibaba import ALIBABA_MEMORY_TOTAL, DEFAULT_TEAMS
from collector.recordings.read import read_recording
from collector.recordings.recording import Recording
from store.db import Store
from store.errors import InvalidInput
from store.ingest import sample_errors, write_samples_on
from store.models import Device, DeviceSample, ProcessSample
from store.registry import (
    DeviceSpec,
    add_processes,
    forget_processes,
    known_processes,
    register_devices,
    register_host,
)
from store.samples import DEVICE_SAMPLE_COLUMNS, INT_METRICS, PROCESS_SAMPLE_COLUMNS
from store.workflows import upsert_workflow


@dataclass(frozen=True)
class LoadSummary:
    kind: str
    hosts: int
    devices: int
    workflows: int
    device_samples: int
    process_samples: int
    skipped_rows: int
    start: float  # first sample's time in the store (after the shift)
    end: float  # last sample's time in the store
    offset: float  # store time = end + (recorded time - recorded end) / speedup
    speedup: float
    seconds: float  # wall time the load took
    device_ids: dict[tuple[str, int], int] = field(default_factory=dict, repr=False)


def _column(values: pd.Series, integer: bool) -> list[Any]:
    """A column as native Python values with NaN as None (psycopg's COPY wants ints for BIGINT columns)."""
    out = values.tolist()
    if integer:
        return [None if v is None or v != v else int(v) for v in out]
    return [None if v is None or v != v else v for v in out]


def _tuples(df: pd.DataFrame, columns: Sequence[str], integers: Iterable[str]) -> list[tuple[Any, ...]]:
    ints = set(integers)
    return list(zip(*(_column(df[c], c in ints) for c in columns), strict=True)) if len(df) else []


def load_into_store(
    store: Store,
    path_or_kind: str | Path | Recording = "alibaba",
    *,
    end_at: float | None = None,
    speedup: float = 1.0,
    replace: bool = True,
    devices_per_host: int = 8,
    memory_total: int = ALIBABA_MEMORY_TOTAL,
    teams: Sequence[str] | None = DEFAULT_TEAMS,
    containers: int | None = None,
    host_prefix: str = "",
    fleet_data_dir: Path | None = None,
) -> LoadSummary:
    """Write a whole recording into the store in one go: hosts, devices, workflows, processes, samples.

    Times are shifted so the recording ends at `end_at` (default: now); `speedup` > 1 compresses it
    (store time = end_at + (recorded time - recorded end) / speedup). With `replace`, the samples and
    processes an earlier load left on the recording's devices and hosts are replaced, so loading again never
    doubles them; the old samples go in the transaction that writes the new ones, so a load whose samples fail
    leaves the old ones in place. Hosts, devices and workflows are committed before the samples: a load that fails
    half-way is repaired by loading again.
    `host_prefix` renames the recording's hosts (and device uuids), e.g. to load an export beside its origin.
    """
    t0 = time.perf_counter()
    if speedup <= 0 or not math.isfinite(speedup):
        raise InvalidInput(f"speedup must be a positive number, not {speedup}")
    rec = path_or_kind if isinstance(path_or_kind, Recording) else read_recording(
        path_or_kind, devices_per_host=devices_per_host, memory_total=memory_total, teams=teams,
        containers=containers, fleet_data_dir=fleet_data_dir,
    )
    end_at = time.time() if end_at is None else float(end_at)
    rec_end = rec.end

    def shift(t: float | None) -> float | None:
        return None if t is None else end_at + (float(t) - rec_end) / speedup

    def hid(host_id: str) -> str:
        return f"{host_prefix}{host_id}"

    try:
        device_ids = _register(store, rec, hid, shift, end_at, replace, host_prefix)
    except IntegrityError as exc:
        raise InvalidInput(
            f"the recording's devices clash with devices already in the store ({exc.orig}); load it under "
            "other host names with host_prefix (`fleetlens load-replay --host-prefix replay-`)"
        ) from None

    dev = rec.device_samples
    proc = rec.process_samples
    dev_rows = _frame_rows(dev, device_ids, hid, shift_ts=lambda s: end_at + (s - rec_end) / speedup,
                           columns=DEVICE_SAMPLE_COLUMNS, integers=INT_METRICS)
    proc_rows = _frame_rows(proc, device_ids, hid, shift_ts=lambda s: end_at + (s - rec_end) / speedup,
                            columns=PROCESS_SAMPLE_COLUMNS, integers=("mem_used", "pid"))
    with sample_errors(store), store.engine.begin() as conn:
        if replace and device_ids:
            ids = list(device_ids.values())
            conn.execute(delete(DeviceSample).where(DeviceSample.device_id.in_(ids)))
            conn.execute(delete(ProcessSample).where(ProcessSample.device_id.in_(ids)))
        n_dev, n_proc = write_samples_on(conn, store.is_postgres, dev_rows, proc_rows)
    skipped = sum(rec.skipped.values())
    return LoadSummary(
        kind=rec.kind, hosts=len(rec.hosts), devices=len(device_ids), workflows=len(rec.workflows),
        device_samples=n_dev, process_samples=n_proc, skipped_rows=skipped,
        start=end_at + (rec.start - rec_end) / speedup if n_dev else end_at, end=end_at,
        offset=end_at - rec_end, speedup=speedup, seconds=time.perf_counter() - t0, device_ids=device_ids,
    )


def _register(
    store: Store, rec: Recording, hid: Callable[[str], str], shift: Callable[[float | None], float | None],
    end_at: float, replace: bool, uuid_prefix: str,
) -> dict[tuple[str, int], int]:
    """Hosts, devices, workflows and processes of a recording, in one transaction; {key: device id}."""
    with store.session() as session:
        for h in rec.hosts:
            register_host(session, hid(h["id"]), hostname=h.get("hostname") or hid(h["id"]), source="replay",
                          labels=h.get("labels") or {}, now=end_at)
        by_host: dict[str, list[DeviceSpec]] = {}
        for d in rec.devices:
            by_host.setdefault(hid(d["host_id"]), []).append(
                DeviceSpec(index=int(d["index"]), uuid=f"{uuid_prefix}{d['uuid']}", name=d["name"],
                           memory_total=d.get("memory_total"),
                           cpu_cores=tuple(d["cpu_cores"]) if d.get("cpu_cores") else None)
            )
        device_ids: dict[tuple[str, int], int] = {}
        for host_id, specs in by_host.items():
            for index, device_id in register_devices(session, host_id, specs, source="replay", now=end_at).items():
                device_ids[(host_id, index)] = device_id
        for w in rec.workflows:
            fields = {k: v for k, v in w.items() if k not in ("id", "created_at", "last_seen")}
            wf = upsert_workflow(session, w["id"], now=shift(w.get("created_at")) or end_at, **fields)
            wf.created_at = shift(w.get("created_at")) or end_at
            wf.last_seen = shift(w.get("last_seen")) or end_at
        host_ids = sorted({hid(h["id"]) for h in rec.hosts})
        if replace:
            forget_processes(session, host_ids)
            existing: set[tuple[str, int, float]] = set()
        else:  # appending: a process already recorded (same host, pid and start) is kept, not duplicated
            existing = known_processes(session, host_ids)
        rows = [
            {"host_id": hid(p["host_id"]), "pid": int(p["pid"]), "start_time": shift(p["start_time"]),
             "workflow_id": p["workflow_id"], "cmdline": p.get("cmdline"), "username": None,
             "first_seen": shift(p["start_time"]), "last_seen": shift(p.get("end_time")) or end_at,
             "ended_at": shift(p.get("end_time"))}
            for p in rec.processes
        ]
        add_processes(session, [r for r in rows if (r["host_id"], r["pid"], r["start_time"]) not in existing])
    return device_ids


def _frame_rows(
    df: pd.DataFrame,
    device_ids: dict[tuple[str, int], int],
    hid: Callable[[str], str],
    *,
    shift_ts: Callable[[pd.Series], pd.Series],
    columns: Sequence[str],
    integers: Iterable[str],
) -> list[tuple[Any, ...]]:
    if not len(df):
        return []
    out = df.copy()
    keys = list(zip(out["host_id"].map(hid), out["device_index"].astype(int), strict=True))
    out["device_id"] = [device_ids.get(k) for k in keys]
    out = out[out["device_id"].notna()]
    out["ts"] = shift_ts(out["ts"].astype(float))
    if "host_id" in columns:
        out["host_id"] = out["host_id"].map(hid)
    return _tuples(out, columns, set(integers) | {"device_id"})


def device_ids_of(store: Store, host_ids: Iterable[str]) -> dict[tuple[str, int], int]:
    """{(host id, index): device id} for the given hosts (to find a loaded recording's devices again)."""
    with store.session() as session:
        query = select(Device.host_id, Device.index, Device.id).where(Device.host_id.in_(list(host_ids)))
        rows = session.execute(query)
        return {(h, i): d for h, i, d in rows}
