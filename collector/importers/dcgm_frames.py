"""The importer's arithmetic: fetched series into per-device column arrays, counters carried across resets and
runs, and the sample batches store.ingest writes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from collector.dcgm_names import BY_NAME, DEVICE_WORKFLOW, FIELDS
from collector.importers.dcgm_labels import (
    DeviceKey,
    WorkflowKey,
    as_written,
    device_of,
    renamed_labels,
    synthetic_pid,
    target_of,
    workflow_of,
)
from store.ingest import DEVICE_SAMPLE_COLUMNS, PROCESS_SAMPLE_COLUMNS
from store.settings import Settings

SAMPLE_COLUMNS = tuple(c for c in DEVICE_SAMPLE_COLUMNS if c not in ("device_id", "ts"))
INT_COLUMNS = frozenset({"mem_used", "mem_total", "throttle_reasons", "xid_errors", "ecc_errors"})
PRIO = {f.name: i for i, f in enumerate(FIELDS)}
COLUMNS = ("gpu_util", "mem_util", "mem_used", "mem_free", "mem_reserved", "power_w", "temperature_c", "sm_clock_mhz",
           "throttle_reasons", "sm_active", "sm_occupancy", "tensor_active", "ecc_errors", "xid_code")


@dataclass
class Parsed:
    """The fetched series by device: per device {column: (priority, times, values)} in the store's units, and per
    (device, workflow) the times that workflow's series have on it."""

    devices: list[DeviceKey] = field(default_factory=list)
    workflows: list[WorkflowKey] = field(default_factory=list)
    columns: list[dict[str, tuple[int, np.ndarray, np.ndarray]]] = field(default_factory=list)
    users: dict[tuple[int, int], list[np.ndarray]] = field(default_factory=dict)


def parse(series: list[dict[str, Any]], settings: Settings, skipped: dict[str, set]) -> Parsed:
    out = Parsed()
    # one device per (host, index): dcgm-exporter 1.x's series of a GPU carry no modelName, today's do, so their
    # DeviceKeys differ while both are the same GPU (a fleet half-way through an upgrade); the device is named by
    # its highest-priority series (today's names come first)
    dev_index: dict[tuple[str, int], int] = {}
    dev_prio: list[int] = []
    wf_index: dict[WorkflowKey, int] = {}
    # scrape targets whose pod labels Prometheus renamed (kube-prometheus): on each of their series, pod, namespace
    # and container are the target's, even where dcgm-exporter wrote none (a GPU no workload uses)
    renamed: dict[tuple[str, str], frozenset[str]] = {}
    for s in series:
        names = renamed_labels(s["metric"])
        if names:
            target = target_of(s["metric"])
            renamed[target] = renamed.get(target, frozenset()) | names
    users: list[tuple[DeviceKey, dict[str, str], np.ndarray]] = []  # an agent's fleetlens_device_workflow series
    for s in series:
        name = s["metric"].get("__name__", "")
        f = BY_NAME.get(name)
        points = s["values"]
        if (f is None and name != DEVICE_WORKFLOW) or not points:
            continue
        labels = as_written(s["metric"], renamed.get(target_of(s["metric"]), frozenset()))
        dev = device_of(labels)
        if isinstance(dev, str):
            skipped.setdefault(dev, set()).add(tuple(sorted(labels.items())))
            continue
        if f is None:  # which workflow uses the device, apart from its readings
            users.append((dev, labels, np.fromiter((p[0] for p in points), float, len(points))))
            continue
        prio = PRIO[name]
        d = dev_index.get((dev.host, dev.index))
        if d is None:
            d = dev_index[(dev.host, dev.index)] = len(out.devices)
            out.devices.append(dev)
            out.columns.append({})
            dev_prio.append(prio)
        elif prio < dev_prio[d]:
            out.devices[d], dev_prio[d] = dev, prio
        ts = np.fromiter((p[0] for p in points), float, len(points))
        values = np.array([p[1] for p in points], dtype=float) * f.scale
        ok = np.isfinite(values)
        if not ok.all():
            ts, values = ts[ok], values[ok]
        have = out.columns[d].get(f.column)
        if have is None or prio < have[0]:
            out.columns[d][f.column] = (prio, ts, values)
        elif prio == have[0]:  # one GPU's series per pod using it: the same readings, maybe at other times
            both_ts, first = np.unique(np.concatenate([have[1], ts]), return_index=True)
            out.columns[d][f.column] = (prio, both_ts, np.concatenate([have[2], values])[first])
        _add_user(out, wf_index, d, workflow_of(labels, settings), ts)
    for dev, labels, ts in users:
        d = dev_index.get((dev.host, dev.index))
        if d is not None:  # a device without readings has no samples to attribute
            _add_user(out, wf_index, d, workflow_of(labels, settings), ts)
    return out


def _add_user(out: Parsed, wf_index: dict[WorkflowKey, int], d: int, wf: WorkflowKey | None, ts: np.ndarray) -> None:
    if wf is None:
        return
    w = wf_index.get(wf)
    if w is None:
        w = wf_index[wf] = len(out.workflows)
        out.workflows.append(wf)
    out.users.setdefault((d, w), []).append(ts)


def wide_columns(parsed: Parsed) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Every device's samples as column arrays (dev, ts, COLUMNS, mem_total), sorted by (dev, ts); and the offset of
    each device's first row (device d's rows are offsets[d]:offsets[d + 1])."""
    parts: dict[str, list[np.ndarray]] = {c: [] for c in ("dev", "ts", *COLUMNS)}
    offsets = [0]
    for d, cols in enumerate(parsed.columns):
        times = np.unique(np.concatenate([ts for _, ts, _ in cols.values()]))
        n = len(times)
        parts["dev"].append(np.full(n, d, dtype=np.int64))
        parts["ts"].append(times)
        for col in COLUMNS:
            arr = np.full(n, np.nan)
            if col in cols:
                _, ts, values = cols[col]
                arr[np.searchsorted(times, ts)] = values
            parts[col].append(arr)
        offsets.append(offsets[-1] + n)
    wide = {c: np.concatenate(v) if v else np.array([]) for c, v in parts.items()}
    wide["mem_total"] = wide["mem_used"] + wide["mem_free"] + np.nan_to_num(wide["mem_reserved"])
    return wide, np.array(offsets, dtype=np.int64)


@dataclass(frozen=True)
class Carried:
    """A device's counters where its stored samples end, for the next window or run to carry on from (None: not
    known): ECC errors as stored (kept rising across resets) and as the exporter last reported them, and the XID
    count and the last XID code. An import carries all four from window to window; a new run reads only the stored
    ones (the store keeps no raw value)."""

    ecc: float | None = None
    ecc_raw: float | None = None
    xid: int | None = None
    xid_code: float | None = None


def counters(wide: dict[str, np.ndarray], offsets: np.ndarray, cursor: np.ndarray,
             carried: dict[int, Carried]) -> tuple[int, dict[int, Carried]]:
    """ecc_errors made monotonic across resets, and xid_errors as a count of new XID codes, each carrying on from
    the device's last stored sample (`carried`: dev -> its counters there); returns the resets seen and each
    device's counters after its last new sample.

    The raw values to carry on from are, in order: those carried from the window before; those of the stored point
    fetched again (at or before the cursor); else, with a gap over the stored point, the stored count alone: the
    ECC count then carries on as the larger of the stored count and the new reading (right unless the counter was
    reset in the gap), and a non-zero XID code after a stored non-zero count is taken as the one already counted."""
    resets = 0
    after: dict[int, Carried] = {}
    ecc_all, code_all, ts_all = wide["ecc_errors"], wide["xid_code"], wide["ts"]
    xid_all = np.full(len(ts_all), np.nan)
    for d in range(len(offsets) - 1):
        lo, hi = int(offsets[d]), int(offsets[d + 1])
        was = carried.get(d, Carried())
        old = ts_all[lo:hi] <= cursor[d]  # fetched again only to carry the counts on
        ecc = ecc_all[lo:hi]
        ecc_now, raw_now = was.ecc, was.ecc_raw
        if np.isfinite(ecc).any():
            offset, prev = 0.0, None
            base = np.flatnonzero(old & np.isfinite(ecc))
            if was.ecc is not None and was.ecc_raw is not None:
                prev, offset = was.ecc_raw, was.ecc - was.ecc_raw
            elif was.ecc is not None and len(base):
                prev = float(ecc[base[-1]])
                offset = was.ecc - prev
            new = np.flatnonzero(np.isfinite(ecc) & ~old)
            if prev is None and was.ecc is not None and len(new):  # a gap over the stored point
                prev = float(ecc[new[0]])
                offset = max(0.0, was.ecc - prev)
            for i in new:
                v = float(ecc[i])
                if prev is not None and v < prev:  # it dropped: the counter restarted from zero
                    offset += prev
                    resets += 1
                ecc[i] = offset + v
                prev = v
            if len(new):
                ecc_now, raw_now = float(ecc[new[-1]]), prev
        codes = code_all[lo:hi]
        count, code_now = was.xid, was.xid_code
        if np.isfinite(codes).any():
            base = np.flatnonzero(old & np.isfinite(codes))
            if was.xid_code is not None:
                prev_code: float | None = was.xid_code
            elif len(base):
                prev_code = float(codes[base[-1]])
            else:  # nothing counted yet: the code was 0; else it is the one counted last, whatever it was
                prev_code = None if was.xid else 0.0
            count = int(was.xid or 0)
            out = xid_all[lo:hi]
            for i in np.flatnonzero(np.isfinite(codes) & ~old):
                v = float(codes[i])
                if prev_code is not None and v != prev_code and v != 0:
                    count += 1
                out[i] = count
                prev_code = v
            code_now = prev_code
        after[d] = Carried(ecc_now, raw_now, count, code_now)
    wide["xid_errors"] = xid_all
    return resets, after


def arrow(values: np.ndarray, integer: bool = False) -> pa.Array:
    """A column as an Arrow array with NaN as NULL (and whole numbers as int64 where the store wants BIGINT).

    Most columns of a window are either all present or all missing: those need no mask."""
    missing = np.isnan(values)
    if missing.all():
        return pa.nulls(len(values), pa.int64() if integer else pa.float64())
    if integer:
        values = np.rint(np.where(missing, 0, values)).astype(np.int64)
    return pa.array(values, mask=missing if missing.any() else None)


def processes(parsed: Parsed, wide: dict[str, np.ndarray], offsets: np.ndarray, cursor: np.ndarray
               ) -> dict[tuple[int, int], np.ndarray]:
    """{(dev, workflow): row numbers in `wide`} of the new samples each workflow's series have on each device.

    Only times the device has a row at: a workflow's series of a field another field's series replaced (GPU_UTIL
    kept, GR_ENGINE_ACTIVE not), or an agent's fleetlens_device_workflow, can carry times the device's readings
    lack, and a process sample is one of the device's samples."""
    out = {}
    for (d, w), times in parsed.users.items():
        ts = np.unique(np.concatenate(times))
        ts = ts[ts > cursor[d]]
        if len(ts):
            lo, hi = int(offsets[d]), int(offsets[d + 1])
            device_ts = wide["ts"][lo:hi]
            at = np.searchsorted(device_ts, ts)
            found = at < len(device_ts)
            found[found] = device_ts[at[found]] == ts[found]
            if found.any():
                out[(d, w)] = lo + at[found]
    return out


def device_batch(wide: dict[str, np.ndarray], keep: np.ndarray, dev_ids: np.ndarray) -> pa.RecordBatch:
    """The new device samples (`keep`) as columns, for store.ingest.write_sample_batches_on."""
    if DEVICE_SAMPLE_COLUMNS != ("device_id", "ts", *SAMPLE_COLUMNS):
        raise RuntimeError("store.ingest's device sample columns changed; update the Prometheus importer")
    arrays = [pa.array(dev_ids[wide["dev"][keep]]), pa.array(wide["ts"][keep])]
    arrays += [arrow(wide[c][keep], c in INT_COLUMNS) for c in SAMPLE_COLUMNS]
    return pa.RecordBatch.from_arrays(arrays, names=list(DEVICE_SAMPLE_COLUMNS))


def process_batch(procs: dict[tuple[int, int], np.ndarray], wide: dict[str, np.ndarray], dev_ids: np.ndarray,
                  parsed: Parsed) -> pa.RecordBatch | None:
    """One process sample per new sample of a device a workflow uses: its memory and utilisation are the device's
    (dcgm-exporter's pod series carry the GPU's readings); no CPU reading (left NULL). None when there is none."""
    if not {"device_id", "workflow_id", "host_id", "pid", "ts", "mem_used", "sm_util"} <= set(PROCESS_SAMPLE_COLUMNS):
        raise RuntimeError("store.ingest's process sample columns changed; update the Prometheus importer")
    if not procs:
        return None
    keys = list(procs)
    rows = np.concatenate([procs[k] for k in keys])
    of_key = pa.array(np.repeat(np.arange(len(keys)), [len(procs[k]) for k in keys]))  # each row's (dev, workflow)

    def per_row(values: list[Any], kind: pa.DataType) -> pa.Array:
        return pa.array(values, type=kind).take(of_key)

    return pa.RecordBatch.from_arrays([
        per_row([int(dev_ids[d]) for d, _ in keys], pa.int64()),
        per_row([parsed.workflows[w].id for _, w in keys], pa.string()),
        per_row([parsed.devices[d].host for d, _ in keys], pa.string()),
        per_row([synthetic_pid(parsed.workflows[w].id, parsed.devices[d].uuid) for d, w in keys], pa.int32()),
        pa.array(wide["ts"][rows]), arrow(wide["mem_used"][rows], True), arrow(wide["gpu_util"][rows]),
    ], names=["device_id", "workflow_id", "host_id", "pid", "ts", "mem_used", "sm_util"])
