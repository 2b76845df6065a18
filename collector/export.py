"""fleetlens's own telemetry export: a time range of hosts, devices, workflows, processes and samples in one file.

Two encodings of one record stream, chosen by the file name:

- ``*.jsonl.gz`` / ``*.jsonl`` (default): JSON lines; the first line is the header
  ``{"kind": "fleetlens-export", "version": 1, ...}``, every other line one record with a ``kind`` of
  ``host | device | workflow | process | device_sample | process_sample``.
- ``*.csv.gz`` / ``*.csv``: one CSV table whose columns are ``kind`` plus the union of every kind's fields
  (``EXPORT_COLUMNS``); a field a kind does not have is empty; JSON-valued fields (labels, cpu_cores) are JSON text.

Devices are named by (host_id, device index), never by database ids, so a file loads into any store
(``collector.sources.replay.load_into_store``) or plays live (``ReplaySource``). Reading skips and counts
malformed records; a CSV without the expected columns, or a JSON-lines file without the header, is refused.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from sqlalchemy import and_, or_, select

from collector.sources.replay import METRIC_COLUMNS, Recording
from store.db import Store
from store.errors import InvalidInput
from store.models import Device, DeviceSample, Host, Process, ProcessSample, Workflow

FORMAT = "fleetlens-export"
VERSION = 1

# kind -> (required fields, optional fields)
FIELDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "host": (("id",), ("hostname", "source", "labels")),
    "device": (("host_id", "index", "uuid"), ("name", "source", "memory_total", "cpu_cores")),
    "workflow": (
        ("id",),
        ("id_source", "name", "owner", "team", "labels", "managed", "movable", "gpus", "state", "created_at",
         "last_seen", "mem_persistent", "mem_ephemeral", "declared_steps"),
    ),
    "process": (("host_id", "pid", "start_time", "workflow_id"),
                ("cmdline", "username", "first_seen", "last_seen", "ended_at")),
    "device_sample": (("host_id", "device_index", "ts"), METRIC_COLUMNS),
    "process_sample": (("host_id", "device_index", "workflow_id", "pid", "ts"), ("mem_used", "sm_util", "cpu_util")),
}
EXPORT_COLUMNS: tuple[str, ...] = ("kind", *dict.fromkeys(f for req, opt in FIELDS.values() for f in (*req, *opt)))
JSON_FIELDS = frozenset({"labels", "cpu_cores"})
INT_FIELDS = frozenset({"index", "device_index", "pid", "memory_total", "gpus", "mem_persistent", "mem_ephemeral",
                        "declared_steps", "mem_used", "mem_total", "throttle_reasons", "xid_errors", "ecc_errors"})
FLOAT_FIELDS = frozenset({"ts", "start_time", "created_at", "last_seen", "first_seen", "ended_at",
                          *(c for c in METRIC_COLUMNS if c not in INT_FIELDS), "sm_util", "cpu_util"})
BOOL_FIELDS = frozenset({"managed", "movable"})
STR_FIELDS = frozenset({"id", "host_id", "uuid", "workflow_id"})


@dataclass(frozen=True)
class ExportSummary:
    path: Path
    format: str  # jsonl | csv
    hosts: int
    devices: int
    workflows: int
    processes: int
    device_samples: int
    process_samples: int


def _format_of(path: Path) -> str:
    name = path.name.lower()
    return "csv" if name.endswith((".csv", ".csv.gz")) else "jsonl"


def _open_write(path: Path) -> io.TextIOBase:
    if path.name.lower().endswith(".gz"):
        return gzip.open(path, "wt", encoding="utf-8", newline="")
    return open(path, "w", encoding="utf-8", newline="")  # noqa: SIM115


def _open_read(path: Path) -> io.TextIOBase:
    """A text stream over a plain or gzipped file (told by its magic bytes, not its name)."""
    with open(path, "rb") as f:
        magic = f.read(2)
    if magic == b"\x1f\x8b":
        return gzip.open(path, "rt", encoding="utf-8", newline="")
    return open(path, encoding="utf-8", newline="")  # noqa: SIM115


# ---------------------------------------------------------------------------------------------------- writing


def _records(
    store: Store, start: float, end: float, hosts: list[str] | None
) -> Iterator[tuple[str, dict[str, Any]]]:
    with store.session() as session:
        host_q = select(Host)
        if hosts:
            host_q = host_q.where(Host.id.in_(hosts))
        host_rows = list(session.scalars(host_q.order_by(Host.id)))
        host_ids = [h.id for h in host_rows]
        devices = list(session.scalars(select(Device).where(Device.host_id.in_(host_ids))
                                       .order_by(Device.host_id, Device.index)))
        key_of = {d.id: (d.host_id, d.index) for d in devices}
        processes = list(session.scalars(
            select(Process).where(Process.host_id.in_(host_ids), Process.first_seen <= end,
                                  or_(Process.ended_at.is_(None), Process.ended_at >= start))
        ))
        wf_ids = set(session.scalars(
            select(ProcessSample.workflow_id).distinct()
            .where(ProcessSample.host_id.in_(host_ids), ProcessSample.ts >= start, ProcessSample.ts <= end)
        ))
        wf_ids |= {p.workflow_id for p in processes}
        workflows = list(session.scalars(select(Workflow).where(Workflow.id.in_(sorted(wf_ids))).order_by(Workflow.id)))
        for h in host_rows:
            yield "host", {"id": h.id, "hostname": h.hostname, "source": h.source, "labels": h.labels or {}}
        for d in devices:
            yield "device", {"host_id": d.host_id, "index": d.index, "uuid": d.uuid, "name": d.name,
                             "source": d.source, "memory_total": d.memory_total, "cpu_cores": d.cpu_cores}
        for w in workflows:
            yield "workflow", {f: getattr(w, f) for f in ("id", *FIELDS["workflow"][1])}
        for p in processes:
            yield "process", {f: getattr(p, f) for f in (*FIELDS["process"][0], *FIELDS["process"][1])}
        ids = list(key_of)
        metric_cols = [getattr(DeviceSample, c) for c in METRIC_COLUMNS]
        dev_q = (select(DeviceSample.device_id, DeviceSample.ts, *metric_cols)
                 .where(DeviceSample.device_id.in_(ids), DeviceSample.ts >= start, DeviceSample.ts <= end)
                 .order_by(DeviceSample.ts, DeviceSample.device_id))
        for row in session.execute(dev_q).yield_per(10_000):
            host_id, index = key_of[row[0]]
            rec = {"host_id": host_id, "device_index": index, "ts": row[1]}
            rec.update(zip(METRIC_COLUMNS, row[2:], strict=True))
            yield "device_sample", rec
        proc_q = (select(ProcessSample.device_id, ProcessSample.workflow_id, ProcessSample.pid, ProcessSample.ts,
                         ProcessSample.mem_used, ProcessSample.sm_util, ProcessSample.cpu_util)
                  .where(and_(ProcessSample.device_id.in_(ids), ProcessSample.ts >= start, ProcessSample.ts <= end))
                  .order_by(ProcessSample.ts, ProcessSample.device_id))
        for row in session.execute(proc_q).yield_per(10_000):
            host_id, index = key_of[row[0]]
            yield "process_sample", {"host_id": host_id, "device_index": index, "workflow_id": row[1], "pid": row[2],
                                     "ts": row[3], "mem_used": row[4], "sm_util": row[5], "cpu_util": row[6]}


def write_export(
    store: Store,
    path: str | Path,
    *,
    start: float | None = None,
    end: float | None = None,
    hosts: list[str] | None = None,
) -> ExportSummary:
    """Write hosts, devices, workflows, processes and samples of [start, end] to `path` (format by its name).

    The file is written beside its final name and renamed when complete, so a failed export leaves nothing.
    """
    path = Path(path)
    start = -math.inf if start is None else float(start)
    end = math.inf if end is None else float(end)
    if start > end:
        raise InvalidInput(f"the export range starts ({start}) after it ends ({end})")
    if not path.parent.exists():
        raise InvalidInput(f"cannot write {path}: folder {path.parent} does not exist")
    fmt = _format_of(path)
    counts = dict.fromkeys(FIELDS, 0)
    tmp = path.with_name(f".{path.name}.partial")
    try:
        with _open_write(tmp) as f:
            header = {"kind": FORMAT, "version": VERSION, "exported_at": time.time(),
                      "start": None if math.isinf(start) else start, "end": None if math.isinf(end) else end}
            if fmt == "jsonl":
                f.write(json.dumps(header) + "\n")
                for kind, rec in _records(store, start, end, hosts):
                    f.write(json.dumps({"kind": kind, **rec}, separators=(",", ":")) + "\n")
                    counts[kind] += 1
            else:
                writer = csv.writer(f)
                writer.writerow(EXPORT_COLUMNS)
                for kind, rec in _records(store, start, end, hosts):
                    row = [kind]
                    for col in EXPORT_COLUMNS[1:]:
                        v = rec.get(col)
                        if v is None:
                            row.append("")
                        elif col in JSON_FIELDS:
                            row.append(json.dumps(v))
                        else:
                            row.append(repr(v) if isinstance(v, float) else str(v))
                    writer.writerow(row)
                    counts[kind] += 1
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return ExportSummary(path, fmt, counts["host"], counts["device"], counts["workflow"], counts["process"],
                         counts["device_sample"], counts["process_sample"])


# ---------------------------------------------------------------------------------------------------- reading


class _Malformed(ValueError):
    pass


def _convert(field: str, value: Any) -> Any:
    if value is None or value == "":
        return None
    if field in JSON_FIELDS:
        return json.loads(value) if isinstance(value, str) else value
    if field in INT_FIELDS:
        if isinstance(value, bool):
            raise _Malformed(field)
        number = float(value)
        if not math.isfinite(number) or number != int(number):
            raise _Malformed(field)
        return int(number)
    if field in FLOAT_FIELDS:
        if isinstance(value, bool):
            raise _Malformed(field)
        number = float(value)
        if not math.isfinite(number):
            raise _Malformed(field)
        return number
    if field in BOOL_FIELDS:
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("true", "1"):
            return True
        if str(value).lower() in ("false", "0"):
            return False
        raise _Malformed(field)
    return str(value) if field in STR_FIELDS else value


def _parse(raw: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    kind = raw.get("kind")
    if kind not in FIELDS:
        raise _Malformed("kind")
    required, optional = FIELDS[kind]
    rec: dict[str, Any] = {}
    try:
        for f in required:
            v = _convert(f, raw.get(f))
            if v is None:
                raise _Malformed(f)
            rec[f] = v
        for f in optional:
            rec[f] = _convert(f, raw.get(f))
    except (TypeError, ValueError, json.JSONDecodeError) as exc:
        raise _Malformed(str(exc)) from None
    return kind, rec


def _raw_records(path: Path) -> Iterator[dict[str, Any] | None]:
    """Each record as a dict, or None for a line that is not one (counted as malformed by the caller)."""
    fmt = _format_of(path)
    try:
        with _open_read(path) as f:
            if fmt == "jsonl":
                first = f.readline()
                try:
                    header = json.loads(first)
                except json.JSONDecodeError:
                    header = None
                if not isinstance(header, dict) or header.get("kind") != FORMAT:
                    raise InvalidInput(
                        f"{path} is not a fleetlens export: its first line should be a header with "
                        f'"kind": "{FORMAT}" (write one with `fleetlens export`)'
                    )
                if header.get("version") != VERSION:
                    raise InvalidInput(
                        f"{path} is export version {header.get('version')}; this fleetlens reads {VERSION}"
                    )
                for line in f:
                    if not line.strip():
                        continue
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError:
                        yield None
                        continue
                    yield obj if isinstance(obj, dict) else None
            else:
                reader = csv.reader(f)
                found = next(reader, [])
                missing = [c for c in EXPORT_COLUMNS if c not in found]
                if missing:
                    raise InvalidInput(
                        f"{path.name} lacks columns {missing}: expected {list(EXPORT_COLUMNS)}, found {found}"
                    )
                for row in reader:
                    if len(row) != len(found):
                        yield None
                        continue
                    yield dict(zip(found, row, strict=True))
    except (OSError, EOFError, UnicodeDecodeError, csv.Error) as exc:
        raise InvalidInput(f"{path} cannot be read ({exc}); give a file written by `fleetlens export`") from None


def _sample_frame(raws: list[dict[str, Any]], kind: str) -> tuple[pd.DataFrame, int]:
    """Sample records as a typed frame, and how many were malformed (a required field missing or any
    numeric field not a finite number, a count not whole, a name empty)."""
    required, optional = FIELDS[kind]
    columns = [*required, *optional]
    frame = pd.DataFrame.from_records(raws, columns=columns) if raws else pd.DataFrame(columns=columns)
    ok = pd.Series(True, index=frame.index)
    for col in columns:
        values = frame[col]
        if col in STR_FIELDS:
            text = values.where(values.notna(), "").astype(str)
            if col in required:
                ok &= text != ""
            frame[col] = text
            continue
        given = values.notna() & (values.astype(str) != "")
        is_bool = values.map(lambda v: isinstance(v, bool)) if values.dtype == object else False
        number = pd.to_numeric(values.where(given, None), errors="coerce")
        finite = np.isfinite(number.astype(float))
        ok &= ~given | (finite & ~is_bool)
        if col in INT_FIELDS:
            ok &= ~given | (number.fillna(0) == np.floor(number.fillna(0)))
        if col in required:
            ok &= given
        frame[col] = number.where(finite)
    frame = frame[ok]
    if len(frame):
        frame = frame.astype({"device_index": int, **({"pid": int} if "pid" in frame else {})})
    return frame.reset_index(drop=True), int((~ok).sum())


def read_export(path: str | Path) -> Recording:
    """A fleetlens export as a Recording; malformed records are skipped and counted in `skipped`."""
    path = Path(path)
    if not path.exists():
        raise InvalidInput(f"export file {path} does not exist")
    by_kind: dict[str, list[dict[str, Any]]] = {k: [] for k in FIELDS}
    raw_samples: dict[str, list[dict[str, Any]]] = {"device_sample": [], "process_sample": []}
    bad = 0
    for raw in _raw_records(path):
        if raw is None:
            bad += 1
            continue
        kind = raw.get("kind")
        if kind in raw_samples:  # the bulk of a file: checked column-wise below, not field by field
            raw_samples[kind].append(raw)
            continue
        try:
            kind, rec = _parse(raw)
        except _Malformed:
            bad += 1
            continue
        by_kind[kind].append(rec)
    dev, bad_dev = _sample_frame(raw_samples["device_sample"], "device_sample")
    proc, bad_proc = _sample_frame(raw_samples["process_sample"], "process_sample")
    bad += bad_dev + bad_proc
    known = {(d["host_id"], d["index"]) for d in by_kind["device"]}
    orphans = 0
    if len(dev):
        ok = [k in known for k in zip(dev["host_id"], dev["device_index"], strict=True)]
        orphans += len(dev) - sum(ok)
        dev = dev[ok]
    if len(proc):
        ok = [k in known for k in zip(proc["host_id"], proc["device_index"], strict=True)]
        orphans += len(proc) - sum(ok)
        proc = proc[ok]
    skipped = {}
    if bad:
        skipped["malformed records"] = bad
    if orphans:
        skipped["samples of devices the file does not declare"] = orphans
    hosts = [{"id": h["id"], "hostname": h.get("hostname"), "labels": h.get("labels") or {}} for h in by_kind["host"]]
    declared_hosts = {h["id"] for h in hosts}
    for d in by_kind["device"]:  # a device's host is implied even if its host line was lost
        if d["host_id"] not in declared_hosts:
            hosts.append({"id": d["host_id"], "hostname": d["host_id"], "labels": {}})
            declared_hosts.add(d["host_id"])
    devices = [{**d, "name": d.get("name") or d["uuid"]} for d in by_kind["device"]]
    workflows = [{k: v for k, v in w.items() if v is not None} for w in by_kind["workflow"]]
    wf_known = {w["id"] for w in workflows}
    needed = set(proc["workflow_id"]) if len(proc) else set()
    needed |= {p["workflow_id"] for p in by_kind["process"]}
    workflows += [{"id": wid} for wid in sorted(needed - wf_known)]  # a sample names its workflow: keep it
    unique = {(p["host_id"], p["pid"], p["start_time"]): p for p in by_kind["process"]}
    processes = [
        {"host_id": p["host_id"], "pid": p["pid"], "workflow_id": p["workflow_id"], "cmdline": p.get("cmdline"),
         "start_time": p["start_time"], "end_time": p.get("ended_at")}
        for p in unique.values()
    ]
    return Recording("export", hosts, devices, workflows, processes, dev.reset_index(drop=True),
                     proc.reset_index(drop=True), skipped)
