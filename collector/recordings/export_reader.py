"""A fleetlens export file read back as a Recording; malformed records are skipped and counted.

A CSV without the expected columns, or a JSON-lines file without the header, is refused with InvalidInput.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from collector.recordings.export_format import (
    BOOL_FIELDS,
    EXPORT_COLUMNS,
    FIELDS,
    FLOAT_FIELDS,
    FORMAT,
    INT_FIELDS,
    JSON_FIELDS,
    STR_FIELDS,
    VERSION,
    format_of,
)
from collector.recordings.recording import Recording
from store.errors import InvalidInput


def _open_read(path: Path) -> io.TextIOBase:
    """A text stream over a plain or gzipped file (told by its magic bytes, not its name)."""
    with open(path, "rb") as f:
        magic = f.read(2)
    if magic == b"\x1f\x8b":
        return gzip.open(path, "rt", encoding="utf-8", newline="")
    return open(path, encoding="utf-8", newline="")  # noqa: SIM115


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
    fmt = format_of(path)
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
