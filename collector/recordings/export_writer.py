"""A time range of a store written to a file in fleetlens's export format (collector.recordings.export_format)."""

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

from sqlalchemy import and_, or_, select

from collector.recordings.export_format import EXPORT_COLUMNS, FIELDS, FORMAT, JSON_FIELDS, VERSION, format_of
from store.db import Store
from store.errors import InvalidInput, NotFound
from store.models import Device, DeviceSample, Host, Process, ProcessSample, Workflow
from store.samples import DEVICE_METRICS, PROCESS_METRICS


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


def _open_write(path: Path) -> io.TextIOBase:
    if path.name.lower().endswith(".gz"):
        return gzip.open(path, "wt", encoding="utf-8", newline="")
    return open(path, "w", encoding="utf-8", newline="")  # noqa: SIM115


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
        metric_cols = [getattr(DeviceSample, c) for c in DEVICE_METRICS]
        dev_q = (select(DeviceSample.device_id, DeviceSample.ts, *metric_cols)
                 .where(DeviceSample.device_id.in_(ids), DeviceSample.ts >= start, DeviceSample.ts <= end)
                 .order_by(DeviceSample.ts, DeviceSample.device_id))
        for row in session.execute(dev_q).yield_per(10_000):
            host_id, index = key_of[row[0]]
            rec = {"host_id": host_id, "device_index": index, "ts": row[1]}
            rec.update(zip(DEVICE_METRICS, row[2:], strict=True))
            yield "device_sample", rec
        proc_metric_cols = [getattr(ProcessSample, c) for c in PROCESS_METRICS]
        proc_q = (select(ProcessSample.device_id, ProcessSample.workflow_id, ProcessSample.pid, ProcessSample.ts,
                         *proc_metric_cols)
                  .where(and_(ProcessSample.device_id.in_(ids), ProcessSample.ts >= start, ProcessSample.ts <= end))
                  .order_by(ProcessSample.ts, ProcessSample.device_id))
        for row in session.execute(proc_q).yield_per(10_000):
            host_id, index = key_of[row[0]]
            rec = {"host_id": host_id, "device_index": index, "workflow_id": row[1], "pid": row[2], "ts": row[3]}
            rec.update(zip(PROCESS_METRICS, row[4:], strict=True))
            yield "process_sample", rec


def _check_hosts(store: Store, hosts: list[str]) -> None:
    """Refuse hosts the store does not know: a misspelt --host would otherwise export an empty file."""
    with store.session() as session:
        known = set(session.scalars(select(Host.id).where(Host.id.in_(hosts))))
    missing = sorted(set(hosts) - known)
    if missing:
        raise NotFound(f"no host {', '.join(map(repr, missing))} in the store; nothing exported")


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
    if path.is_dir():
        raise InvalidInput(f"cannot write {path}: it is a folder; give a file name, e.g. {path / 'export.jsonl.gz'}")
    if hosts:
        _check_hosts(store, hosts)
    fmt = format_of(path)
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
    except OSError as exc:  # the disk full, the folder not writable: said in one line, nothing left behind
        tmp.unlink(missing_ok=True)
        raise InvalidInput(f"cannot write {path}: {exc.strerror or exc}") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return ExportSummary(path, fmt, counts["host"], counts["device"], counts["workflow"], counts["process"],
                         counts["device_sample"], counts["process_sample"])
