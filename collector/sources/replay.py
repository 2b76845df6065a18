"""Recorded telemetry played as virtual hosts and devices: bulk-loaded into a store, or sampled live at a speed-up.

Two recordings are understood:

- ``alibaba``: the Alibaba GenAI cluster trace (alibaba/clusterdata, cluster-trace-v2026-GenAI) as two CSV files,
  per-container GPU duty cycle (%) and GPU memory used (bytes), columns ``value, timestamp_anon, container_ip``,
  one sample about every 57 s over 22.8 h. Each container that has a duty-cycle series is one workflow alone on
  its own virtual GPU; ``devices_per_host`` (8) consecutive containers, in order of first appearance, share a
  virtual host ``alibaba-hNN``. The trace does not name the GPU model; its largest container uses 47.3 GiB, so
  every virtual device has ``ALIBABA_MEMORY_TOTAL`` = 80 GiB (the A100/H800-80GB class that serves such models).
  One container of the memory file has no duty-cycle series (a single 0-byte row); it is left out and counted.
- ``export``: fleetlens's own format (``collector.export``), gzipped JSON lines or CSV.

Malformed rows are skipped, counted, and reported in one log warning; the rest is played. A file that lacks the
columns a format needs raises InvalidInput naming the expected and the found columns.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from sqlalchemy import delete, func, insert, select
from sqlalchemy.exc import IntegrityError

from collector.sources.base import DeviceInfo, DeviceReading, ProcessReading
from store.db import Store
from store.errors import InvalidInput
from store.ingest import DEVICE_SAMPLE_COLUMNS, PROCESS_SAMPLE_COLUMNS, write_samples
from store.models import Device, DeviceSample, Process, ProcessSample
from store.registry import DeviceSpec, register_devices, register_host
from store.settings import get_settings
from store.workflows import upsert_workflow

log = logging.getLogger(__name__)

GiB = 1 << 30
ALIBABA_MEMORY_TOTAL = 80 * GiB
ALIBABA_DUTY_FILE = "alibaba_genai_pod_gpu_duty_cycle.csv.gz"
ALIBABA_MEMORY_FILE = "alibaba_genai_pod_gpu_memory_used_bytes.csv.gz"
ALIBABA_COLUMNS = ("value", "timestamp_anon", "container_ip")
ALIBABA_PID_BASE = 100_000  # synthetic pids: one process per container, never a real pid on a 32-bit pid_max host
# Teams are not in the trace: a deterministic, labelled-synthetic assignment lets rankings group by team.
DEFAULT_TEAMS: tuple[str, ...] = ("search", "ads", "recsys", "vision", "speech", "llm")

METRIC_COLUMNS: tuple[str, ...] = tuple(c for c in DEVICE_SAMPLE_COLUMNS if c not in ("device_id", "ts"))
INT_METRICS = frozenset({"mem_used", "mem_total", "throttle_reasons", "xid_errors", "ecc_errors"})
PROCESS_METRICS: tuple[str, ...] = ("mem_used", "sm_util", "cpu_util")


@dataclass
class Recording:
    """A whole recording in memory, with times as recorded (epoch seconds).

    ``device_samples`` columns: host_id, device_index, ts, and METRIC_COLUMNS.
    ``process_samples`` columns: host_id, device_index, workflow_id, pid, ts, mem_used, sm_util, cpu_util.
    """

    kind: str
    hosts: list[dict[str, Any]]  # id, hostname, labels
    devices: list[dict[str, Any]]  # host_id, index, uuid, name, memory_total, cpu_cores
    workflows: list[dict[str, Any]]  # id plus Workflow column values
    processes: list[dict[str, Any]]  # host_id, pid, workflow_id, cmdline, start_time, end_time
    device_samples: pd.DataFrame
    process_samples: pd.DataFrame
    skipped: dict[str, int] = field(default_factory=dict)

    @property
    def start(self) -> float:
        return float(self.device_samples["ts"].min()) if len(self.device_samples) else 0.0

    @property
    def end(self) -> float:
        return float(self.device_samples["ts"].max()) if len(self.device_samples) else 0.0


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


# ---------------------------------------------------------------------------------------------------- reading


def resolve(path_or_kind: str | Path) -> tuple[str, Path]:
    """("alibaba" | "export", path) for "alibaba", an Alibaba folder or file, or an export file."""
    if isinstance(path_or_kind, str) and path_or_kind == "alibaba":
        return "alibaba", Path(get_settings().fleet_data_dir)
    path = Path(path_or_kind)
    if path.is_dir():
        if (path / ALIBABA_DUTY_FILE).exists():
            return "alibaba", path
        raise InvalidInput(f"{path} holds no {ALIBABA_DUTY_FILE}; give the folder of the Alibaba GenAI trace")
    if not path.exists():
        raise InvalidInput(f"replay file {path} does not exist; give 'alibaba', its folder, or a fleetlens export")
    if path.name in (ALIBABA_DUTY_FILE, ALIBABA_MEMORY_FILE):
        return "alibaba", path.parent
    return "export", path


def read_recording(
    path_or_kind: str | Path,
    *,
    devices_per_host: int = 8,
    memory_total: int = ALIBABA_MEMORY_TOTAL,
    teams: Sequence[str] | None = DEFAULT_TEAMS,
    containers: int | None = None,
) -> Recording:
    """Read a whole recording; `containers` keeps only the first N Alibaba containers (tests, small demos)."""
    kind, path = resolve(path_or_kind)
    if kind == "alibaba":
        rec = read_alibaba(path, devices_per_host=devices_per_host, memory_total=memory_total, teams=teams,
                           containers=containers)
    else:
        from collector.export import read_export

        rec = read_export(path)
    if rec.skipped:
        log.warning("replay %s: skipped %d malformed rows (%s); played the rest", path, sum(rec.skipped.values()),
                    ", ".join(f"{k}: {v}" for k, v in sorted(rec.skipped.items())))
    return rec


def _read_alibaba_csv(path: Path, skipped: dict[str, int]) -> pd.DataFrame:
    """value, ts, container with malformed rows dropped and counted (either column order)."""
    if not path.exists():
        raise InvalidInput(f"{path} is missing; the Alibaba replay needs {ALIBABA_DUTY_FILE} and {ALIBABA_MEMORY_FILE}")
    stat = path.stat()
    out, n_bad, n_dup = _parse_alibaba_csv(str(path), stat.st_mtime_ns, stat.st_size)
    if n_bad:
        skipped[path.name] = skipped.get(path.name, 0) + n_bad
    if n_dup:
        skipped[f"{path.name} duplicates"] = n_dup
    return out


@lru_cache(maxsize=4)
def _parse_alibaba_csv(path_text: str, _mtime_ns: int, _size: int) -> tuple[pd.DataFrame, int, int]:
    """Parsed once per file version (tests and the demo load the same trace many times); callers never mutate it."""
    path = Path(path_text)
    try:
        found = list(pd.read_csv(path, nrows=0).columns)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError, OSError, EOFError) as exc:
        raise InvalidInput(f"{path} cannot be read as CSV ({exc})") from None
    missing = [c for c in ALIBABA_COLUMNS if c not in found]
    if missing:
        raise InvalidInput(f"{path.name} lacks columns {missing}: expected {list(ALIBABA_COLUMNS)}, found {found}")
    bad_lines = 0

    def on_bad(_fields: list[str]) -> None:
        nonlocal bad_lines
        bad_lines += 1
        return None

    numeric = {"value": "float64", "timestamp_anon": "float64", "container_ip": str}
    try:
        try:  # the clean file: typed C parser, ~10x faster than parsing text and converting
            df = pd.read_csv(path, dtype=numeric, on_bad_lines="error", engine="c")
        except (ValueError, pd.errors.ParserError):
            # a damaged file: read text with the Python parser (it can count bad lines), convert, drop what fails
            df = pd.read_csv(path, dtype=str, keep_default_na=False, on_bad_lines=on_bad, engine="python")
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError, OSError, EOFError) as exc:
        raise InvalidInput(f"{path} cannot be read as CSV ({exc})") from None
    container = df["container_ip"].fillna("").astype(str)
    if df["container_ip"].dtype == object and container.str.contains(r"^\s|\s$", regex=True).any():
        container = container.str.strip()
    out = pd.DataFrame(
        {
            "value": pd.to_numeric(df["value"], errors="coerce"),
            "ts": pd.to_numeric(df["timestamp_anon"], errors="coerce"),
            "container": container,
        }
    )
    ok = np.isfinite(out["value"]) & np.isfinite(out["ts"]) & (out["value"] >= 0) & (out["container"] != "")
    n_bad = int((~ok).sum()) + bad_lines
    out = out[ok]
    dup = out.duplicated(["ts", "container"], keep="last")
    n_dup = int(dup.sum())
    if n_dup:
        out = out[~dup]
    return out, n_bad, n_dup


def read_alibaba(
    folder: Path,
    *,
    devices_per_host: int = 8,
    memory_total: int = ALIBABA_MEMORY_TOTAL,
    teams: Sequence[str] | None = DEFAULT_TEAMS,
    containers: int | None = None,
) -> Recording:
    if devices_per_host < 1:
        raise InvalidInput(f"devices_per_host must be at least 1, not {devices_per_host}")
    skipped: dict[str, int] = {}
    duty = _read_alibaba_csv(folder / ALIBABA_DUTY_FILE, skipped)
    mem = _read_alibaba_csv(folder / ALIBABA_MEMORY_FILE, skipped)
    over = duty["value"] > 100.0 + 1e-9  # a duty cycle is a percentage
    if over.any():
        skipped[ALIBABA_DUTY_FILE] = skipped.get(ALIBABA_DUTY_FILE, 0) + int(over.sum())
        duty = duty[~over]
    # containers in order of first appearance (then by id, so the layout never depends on row order)
    first = duty.groupby("container")["ts"].min().reset_index().sort_values(["ts", "container"])
    names = list(first["container"])
    if containers is not None:
        names = names[:containers]
    known = set(names)
    memory_only = mem[~mem["container"].isin(set(duty["container"]))]
    if len(memory_only):
        skipped["memory rows of containers without a duty-cycle series"] = len(memory_only)
    mem = mem[mem["container"].isin(known)]
    duty = duty[duty["container"].isin(known)]

    merged = pd.merge(
        duty.rename(columns={"value": "duty"}), mem.rename(columns={"value": "mem"}), on=["ts", "container"],
        how="outer",
    ).sort_values(["ts", "container"], kind="stable")

    short = {c: c[:12] for c in names}
    if len(set(short.values())) != len(short):  # a 12-hex-digit prefix collision: use the whole hash
        short = {c: c for c in names}
    wf_ids = {c: f"alibaba-{short[c]}" for c in names}
    slot = {c: i for i, c in enumerate(names)}
    host_of = {c: f"alibaba-h{slot[c] // devices_per_host:02d}" for c in names}

    end = float(merged["ts"].max()) if len(merged) else 0.0
    span = merged.groupby("container")["ts"].agg(["min", "max"])
    hosts = [
        {"id": h, "hostname": h, "labels": {"replay": "alibaba"}}
        for h in sorted(set(host_of.values()))
    ]
    devices, workflows, processes = [], [], []
    for c in names:
        i = slot[c]
        t_first, t_last = float(span.at[c, "min"]), float(span.at[c, "max"])
        devices.append(
            {"host_id": host_of[c], "index": i % devices_per_host, "uuid": f"replay-{wf_ids[c]}",
             "name": f"replayed GPU {memory_total // GiB} GiB (Alibaba GenAI)", "memory_total": memory_total,
             "cpu_cores": None}
        )
        team = teams[int(c[:8], 16) % len(teams)] if teams else None
        labels: dict[str, Any] = {"replay": "alibaba", "container_ip": c}
        if team:
            labels["team_source"] = "synthetic"
        # a series that stops more than two sampling intervals before the trace does is a finished job
        workflows.append(
            {"id": wf_ids[c], "id_source": "replay", "name": f"serving-{short[c][:8]}", "team": team,
             "labels": labels, "gpus": 1, "state": "running" if t_last >= end - 120 else "finished",
             "created_at": t_first, "last_seen": t_last}
        )
        processes.append(
            {"host_id": host_of[c], "pid": ALIBABA_PID_BASE + i, "workflow_id": wf_ids[c],
             "cmdline": f"alibaba container {c}", "start_time": t_first,
             "end_time": None if t_last >= end - 120 else t_last}
        )

    slot_col = merged["container"].map(slot).to_numpy(dtype=np.int64)
    host_col = np.array([host_of[c] for c in names], dtype=object)[slot_col]
    wf_col = np.array([wf_ids[c] for c in names], dtype=object)[slot_col]
    index_col = slot_col % devices_per_host
    gpu_util = merged["duty"] / 100.0
    dev = pd.DataFrame({"host_id": host_col, "device_index": index_col, "ts": merged["ts"]})
    for col in METRIC_COLUMNS:
        dev[col] = np.nan
    dev["gpu_util"] = gpu_util
    dev["mem_used"] = merged["mem"]
    dev["mem_total"] = float(memory_total)
    proc = pd.DataFrame(
        {"host_id": host_col, "device_index": index_col, "workflow_id": wf_col,
         "pid": ALIBABA_PID_BASE + slot_col, "ts": merged["ts"],
         "mem_used": merged["mem"], "sm_util": gpu_util, "cpu_util": np.nan}
    )
    return Recording("alibaba", hosts, devices, workflows, processes, dev.reset_index(drop=True),
                     proc.reset_index(drop=True), skipped)


# ---------------------------------------------------------------------------------------------------- bulk load


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
) -> LoadSummary:
    """Write a whole recording into the store in one go: hosts, devices, workflows, processes, samples.

    Times are shifted so the recording ends at `end_at` (default: now); `speedup` > 1 compresses it
    (store time = end_at + (recorded time - recorded end) / speedup). With `replace`, the samples and
    processes an earlier load left on the recording's devices and hosts are replaced, so loading again never
    doubles them; the old samples go only after the new ones are written. Hosts, devices and workflows are
    committed before the samples: a load that fails half-way is repaired by loading again.
    `host_prefix` renames the recording's hosts (and device uuids), e.g. to load an export beside its origin.
    """
    t0 = time.perf_counter()
    if speedup <= 0 or not math.isfinite(speedup):
        raise InvalidInput(f"speedup must be a positive number, not {speedup}")
    rec = path_or_kind if isinstance(path_or_kind, Recording) else read_recording(
        path_or_kind, devices_per_host=devices_per_host, memory_total=memory_total, teams=teams,
        containers=containers,
    )
    end_at = time.time() if end_at is None else float(end_at)
    rec_end = rec.end

    def shift(t: float | None) -> float | None:
        return None if t is None else end_at + (float(t) - rec_end) / speedup

    def hid(host_id: str) -> str:
        return f"{host_prefix}{host_id}"

    try:
        device_ids, last_dev, last_proc = _register(store, rec, hid, shift, end_at, replace, host_prefix)
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
    n_dev, n_proc = write_samples(store, dev_rows, proc_rows)
    if replace and device_ids:
        ids = list(device_ids.values())
        with store.session() as session:
            session.execute(delete(DeviceSample).where(DeviceSample.device_id.in_(ids), DeviceSample.id <= last_dev))
            session.execute(
                delete(ProcessSample).where(ProcessSample.device_id.in_(ids), ProcessSample.id <= last_proc)
            )
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
) -> tuple[dict[tuple[str, int], int], int, int]:
    """Hosts, devices, workflows and processes of a recording, in one transaction; ({key: device id}, max ids)."""
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
        # the earlier load's samples are deleted only once the new ones are written (below): a failed load
        # leaves the store as it was, never without samples; rows up to these ids are the earlier load's
        last_dev = session.scalar(select(func.max(DeviceSample.id))) or 0
        last_proc = session.scalar(select(func.max(ProcessSample.id))) or 0
        if replace:
            session.execute(delete(Process).where(Process.host_id.in_(host_ids)))
            existing: set[tuple[str, int, float]] = set()
        else:  # appending: a process already recorded (same host, pid and start) is kept, not duplicated
            existing = set(session.execute(
                select(Process.host_id, Process.pid, Process.start_time).where(Process.host_id.in_(host_ids))
            ).tuples())
        rows = [
            {"host_id": hid(p["host_id"]), "pid": int(p["pid"]), "start_time": shift(p["start_time"]),
             "workflow_id": p["workflow_id"], "cmdline": p.get("cmdline"), "username": None,
             "first_seen": shift(p["start_time"]), "last_seen": shift(p.get("end_time")) or end_at,
             "ended_at": shift(p.get("end_time"))}
            for p in rec.processes
        ]
        rows = [r for r in rows if (r["host_id"], r["pid"], r["start_time"]) not in existing]
        if rows:
            session.execute(insert(Process), rows)
    return device_ids, last_dev, last_proc


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


# ---------------------------------------------------------------------------------------------------- live source


@dataclass
class _Series:
    ts: np.ndarray  # one device's sample times, sorted
    rows: list[list[Any]]  # METRIC_COLUMNS values per sample, None = missing
    pts: np.ndarray  # its process samples' times, sorted
    procs: list[tuple[int, str, int | None, float | None, float | None]]  # pid, workflow, mem, sm, cpu


class ReplaySource:
    """A DeviceSource that plays a recording against the wall clock, `speedup` recorded seconds per second.

    With `host`, only that virtual host's devices are played (one agent per virtual host); without, every
    device of the recording is played as one host, numbered 0..n-1 in the recording's order. Each reading
    carries the recorded workflow id on its processes, so no /proc attribution is needed. With `loop`, the
    recording starts again when it ends; otherwise the last values are held. Device uuids are the recording's
    prefixed by `uuid_prefix` (open_source passes the agent's host id).
    """

    name = "replay"

    def __init__(
        self,
        recording: Recording | str | Path,
        *,
        speedup: float = 60.0,
        host: str | None = None,
        loop: bool = True,
        uuid_prefix: str = "live",
        clock: Callable[[], float] = time.time,
    ) -> None:
        if speedup <= 0 or not math.isfinite(speedup):
            raise InvalidInput(f"replay speed-up must be a positive number, not {speedup}")
        self.recording = recording if isinstance(recording, Recording) else read_recording(recording)
        rec = self.recording
        keys = [(d["host_id"], int(d["index"])) for d in rec.devices]
        if host is not None:
            keys = [k for k in keys if k[0] == host]
            if not keys:
                hosts = sorted({d["host_id"] for d in rec.devices})
                raise InvalidInput(f"the recording has no host {host!r}; it has {hosts[:10]}")
        self.host = host
        self.speedup, self.loop, self._clock = float(speedup), loop, clock
        self._started = clock()
        self._rec_start, self._rec_end = rec.start, rec.end
        by_key = {(d["host_id"], int(d["index"])): d for d in rec.devices}
        wf_source = {w["id"]: w.get("id_source") or "replay" for w in rec.workflows}
        self._infos: list[DeviceInfo] = []
        self._series: list[_Series] = []
        dev_groups = dict(tuple(rec.device_samples.groupby(["host_id", "device_index"], sort=False)))
        proc_groups = dict(tuple(rec.process_samples.groupby(["host_id", "device_index"], sort=False)))
        empty_dev = rec.device_samples.iloc[0:0]
        empty_proc = rec.process_samples.iloc[0:0]
        for local, key in enumerate(keys):
            d = by_key[key]
            index = key[1] if host is not None else local
            # device uuids are unique in the store: a live replay must not take the uuid of the same device
            # bulk-loaded by load_into_store, nor of another agent playing the same recording
            self._infos.append(DeviceInfo(index=index, uuid=f"{uuid_prefix}:{d['uuid']}", name=d["name"],
                                          memory_total=d.get("memory_total")))
            ds = dev_groups.get(key, empty_dev).sort_values("ts", kind="stable")
            ps = proc_groups.get(key, empty_proc).sort_values("ts", kind="stable")
            # plain Python lists per row: a sample of 143 devices must cost microseconds, not pandas lookups
            self._series.append(_Series(
                ts=ds["ts"].to_numpy(dtype=float),
                rows=[[None if v != v else v for v in row] for row in ds[list(METRIC_COLUMNS)].itertuples(
                    index=False, name=None)],
                pts=ps["ts"].to_numpy(dtype=float),
                procs=[(int(pid), str(wf), None if m != m else int(m), None if su != su else float(su),
                        None if cu != cu else float(cu))
                       for pid, wf, m, su, cu in ps[["pid", "workflow_id", "mem_used", "sm_util", "cpu_util"]]
                       .itertuples(index=False, name=None)],
            ))
        self._wf_source = wf_source

    def devices(self) -> list[DeviceInfo]:
        return list(self._infos)

    def position(self) -> float:
        """The recorded time being played now."""
        played = (self._clock() - self._started) * self.speedup
        duration = self._rec_end - self._rec_start
        if self.loop and duration > 0:
            played %= duration + 1e-9
        return min(self._rec_start + played, self._rec_end)

    def sample(self) -> list[DeviceReading]:
        now = self._clock()
        at = self.position()
        readings = []
        for info, series in zip(self._infos, self._series, strict=True):
            reading = DeviceReading(index=info.index, ts=now, mem_total=info.memory_total)
            ts = series.ts
            i = int(np.searchsorted(ts, at, side="right")) - 1
            if i >= 0:
                for col, v in zip(METRIC_COLUMNS, series.rows[i], strict=True):
                    if v is not None:
                        setattr(reading, col, int(v) if col in INT_METRICS else float(v))
                # the processes recorded since the device's previous row belong to this reading
                lo = ts[i - 1] if i > 0 else -math.inf
                a = int(np.searchsorted(series.pts, lo, side="right"))
                b = int(np.searchsorted(series.pts, ts[i], side="right"))
                for pid, wf, mem, sm, cpu in series.procs[a:b]:
                    reading.processes.append(ProcessReading(
                        pid=pid, mem_used=mem, sm_util=sm, cpu_util=cpu, workflow_id=wf,
                        id_source=self._wf_source.get(wf, "replay"), start_time=self._started,
                    ))
            readings.append(reading)
        return readings

    def workflows(self) -> list[dict[str, Any]]:
        """The recording's workflows (id, team, labels...) for the agent to register."""
        wanted = {p[1] for s in self._series for p in s.procs}
        return [w for w in self.recording.workflows if w["id"] in wanted]

    def close(self) -> None:
        pass


__all__ = ["ALIBABA_MEMORY_TOTAL", "LoadSummary", "Recording", "ReplaySource", "load_into_store", "read_recording"]
