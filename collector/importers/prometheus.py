"""Import a fleet's dcgm-exporter telemetry from an existing Prometheus (HTTP API, query_range) into the store.

Every dcgm-exporter series is one GPU (or MIG instance) of one host, perhaps labelled with the pod, namespace and
container (or HPC job) using it. Its samples become device samples of that device, and, when a pod or job uses it,
process samples of that workflow (one synthetic process per workflow and device: dcgm-exporter does not see pids),
written through store.ingest.write_samples like an agent's.

Incremental and idempotent: a device's last sample in the store is where its series resumes; points at or before it
are never written again, so importing the same range twice writes nothing the second time. The range is taken a
window at a time (FLEETLENS_PROMETHEUS_WINDOW_S, 6 h): a window is fetched and checked whole before any of it is
written, then written in one transaction. Prometheus down, a wrong URL or an answer that is not Prometheus's raises
UpstreamUnavailable / InvalidInput naming what was imported before (nothing, when the first window fails), and the
next run resumes after it. Series without a GPU label (gpu or UUID) or a host label (Hostname or instance) are
skipped and counted. Gaps stay gaps: each point is the last scrape in its step, never an older one. A counter that
drops (DCGM_FI_DEV_ECC_DBE_VOL_TOTAL after a driver reload) is read as a reset: the stored count keeps rising.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
from sqlalchemy import func, insert, select, tuple_, update

from collector.dcgm_names import (
    BY_NAME,
    CONTAINER,
    DEVICE,
    FIELDS,
    GPU,
    HOSTNAME,
    MIG_INSTANCE,
    MIG_PROFILE,
    MODEL,
    NAMESPACE,
    POD,
    SLURM_JOB_LABELS,
    UUID,
    WORKFLOW,
)
from store.db import Store
from store.errors import InvalidInput, UpstreamUnavailable
from store.ingest import DEVICE_SAMPLE_COLUMNS, PROCESS_SAMPLE_COLUMNS, write_samples
from store.models import Device, DeviceSample, Host, Process, Workflow
from store.registry import DeviceSpec, register_devices, register_host
from store.settings import Settings, get_settings

log = logging.getLogger(__name__)

SOURCE = "prometheus"
MAX_POINTS = 10_000  # Prometheus refuses a query_range of more than 11,000 points per series
FETCH_CONCURRENCY = 4
PID_BASE = 1 << 30  # synthetic pids (dcgm-exporter sees no processes), above any real pid_max
MIG_INDEX_BASE = 1000  # a MIG instance's device index: (gpu + 1) * 1000 + GPU_I_ID, apart from whole GPUs
SAMPLE_COLUMNS = tuple(c for c in DEVICE_SAMPLE_COLUMNS if c not in ("device_id", "ts"))
INT_COLUMNS = frozenset({"mem_used", "mem_total", "throttle_reasons", "xid_errors", "ecc_errors"})


@dataclass
class ImportSummary:
    url: str
    since: float
    until: float
    step: float
    series: int = 0  # series fetched
    skipped: dict[str, int] = field(default_factory=dict)  # series left out, by reason
    hosts: int = 0
    devices: int = 0  # devices with new samples
    workflows: int = 0
    device_samples: int = 0  # rows written
    process_samples: int = 0
    counter_resets: int = 0
    fetch_s: float = 0.0
    seconds: float = 0.0

    def describe(self) -> str:
        text = (f"{self.device_samples} device and {self.process_samples} process samples from {self.series} series "
                f"({self.devices} devices on {self.hosts} hosts, {self.workflows} workflows)")
        if self.skipped:
            text += "; skipped " + ", ".join(f"{n} series {why}" for why, n in sorted(self.skipped.items()))
        if self.counter_resets:
            text += f"; {self.counter_resets} counter resets read as resets"
        return text


# ---------------------------------------------------------------------------------------------------- HTTP


class PrometheusClient:
    """Prometheus's HTTP API: query_range, with every failure turned into a message that says what to do."""

    def __init__(self, url: str, *, timeout_s: float = 60.0) -> None:
        if not url.startswith(("http://", "https://")):
            raise InvalidInput(f"{url!r} is not a Prometheus URL; give one like http://prometheus:9090")
        self.url = url.rstrip("/")
        self._http = httpx.Client(base_url=self.url, timeout=timeout_s)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> PrometheusClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def query_range(self, query: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        """The matrix of `query` over [start, end] every `step` s: [{"metric": labels, "values": [[t, "v"]...]}]."""
        params = {"query": query, "start": repr(float(start)), "end": repr(float(end)), "step": repr(float(step))}
        try:
            resp = self._http.get("/api/v1/query_range", params=params)
        except httpx.TimeoutException:
            raise UpstreamUnavailable(f"Prometheus at {self.url} did not answer in time; try again or raise "
                                      "FLEETLENS_PROMETHEUS_TIMEOUT_S") from None
        except httpx.HTTPError as exc:
            raise UpstreamUnavailable(f"Prometheus at {self.url} cannot be reached ({exc}); check the URL and that "
                                      "Prometheus runs") from None
        try:
            body = resp.json()
        except ValueError:
            body = None
        if not isinstance(body, dict) or "status" not in body:
            raise InvalidInput(f"{self.url} answered HTTP {resp.status_code} without Prometheus's JSON to "
                               "/api/v1/query_range; is this the Prometheus server's base URL?")
        if body["status"] != "success":
            raise InvalidInput(f"Prometheus at {self.url} refused the query ({body.get('errorType')}: "
                               f"{body.get('error')})")
        data = body.get("data") or {}
        if data.get("resultType") != "matrix":
            raise InvalidInput(f"Prometheus at {self.url} answered a {data.get('resultType')!r}, not a matrix")
        return data.get("result") or []

    def fetch(self, names: Iterable[str], start: float, end: float, step: float) -> list[dict[str, Any]]:
        """Every series of the metrics `names` over [start, end], in as many query_range calls as Prometheus's
        per-series point limit asks for; the chunks of one series are joined.

        Each point is the last sample scraped in the step before it (last_over_time over one step less a
        millisecond, as Prometheus 2's ranges include both ends), not Prometheus's default of the last sample in
        five minutes: the steps tile time, so every scrape counts once and a gap longer than a step stays a gap
        instead of repeating the value before it.
        """
        chunk = step * (MAX_POINTS - 1)
        windows = []
        t = start
        while t <= end:
            windows.append((t, min(end, t + chunk)))
            t = windows[-1][1] + step
        queries = [(name, lo, hi) for name in names for lo, hi in windows]
        # Prometheus evaluates one query while this process decodes the answer to another
        with ThreadPoolExecutor(max_workers=FETCH_CONCURRENCY) as pool:
            answers = list(pool.map(
                lambda q: self.query_range(f"last_over_time({q[0]}[{max(1, round(step * 1000) - 1)}ms])", q[1], q[2],
                                           step), queries))
        merged: dict[tuple[tuple[str, str], ...], dict[str, Any]] = {}
        for (name, _, _), answer in zip(queries, answers, strict=True):
            for series in answer:
                labels = {**series["metric"], "__name__": name}  # functions drop the metric's name
                key = tuple(sorted(labels.items()))
                if key in merged:
                    merged[key]["values"].extend(series["values"])
                else:
                    merged[key] = {"metric": labels, "values": series["values"]}
        return list(merged.values())


# ---------------------------------------------------------------------------------------------------- labels


@dataclass(frozen=True)
class DeviceKey:
    host: str
    index: int
    uuid: str
    name: str


@dataclass(frozen=True)
class WorkflowKey:
    id: str
    id_source: str
    team: str | None
    labels: tuple[tuple[str, str], ...]


def device_of(labels: dict[str, str]) -> DeviceKey | str:
    """The device a series belongs to, or why it has none."""
    host = labels.get(HOSTNAME) or (labels.get("instance") or "").rsplit(":", 1)[0]
    if not host:
        return "without a Hostname or instance label"
    gpu, uuid = labels.get(GPU), labels.get(UUID)
    if gpu is None and not uuid:
        return "without a gpu or UUID label"
    try:
        index = int(gpu) if gpu is not None else int(hashlib.sha1(uuid.encode()).hexdigest()[:6], 16) % 900
    except ValueError:
        return "with a gpu label that is not a number"
    model = labels.get(MODEL) or "GPU (dcgm-exporter)"
    uuid = uuid or f"{host}:{labels.get(DEVICE) or f'gpu{index}'}"
    instance = labels.get(MIG_INSTANCE)
    if instance not in (None, ""):
        try:
            gi = int(instance)
        except ValueError:
            return "with a GPU_I_ID label that is not a number"
        profile = labels.get(MIG_PROFILE) or f"instance {gi}"
        return DeviceKey(host, (index + 1) * MIG_INDEX_BASE + gi, f"{uuid}/gi{gi}", f"{model} MIG {profile}")
    return DeviceKey(host, index, uuid, model)


def workflow_of(labels: dict[str, str], settings: Settings) -> WorkflowKey | None:
    """The workflow using the device in this series: the workflow a fleetlens agent named, else its HPC (Slurm) job,
    else its Kubernetes pod, else none."""
    team_value = labels.get(settings.prometheus_team_label) or None
    team = settings.prometheus_teams.get(team_value, team_value) if team_value else None
    if labels.get(WORKFLOW):  # a fleetlens agent's /metrics: its own name and team
        kept = tuple((k, labels[k]) for k in (NAMESPACE, POD) if labels.get(k))
        return WorkflowKey(labels[WORKFLOW], SOURCE, labels.get("team") or team, kept)
    for name in SLURM_JOB_LABELS:
        if labels.get(name):
            return WorkflowKey(f"slurm-{labels[name]}", "slurm", team, ((name, labels[name]),))
    pod = labels.get(POD)
    if pod:
        namespace = labels.get(NAMESPACE) or "default"
        kept = tuple((k, labels[k]) for k in (NAMESPACE, POD, CONTAINER) if labels.get(k))
        return WorkflowKey(f"k8s-{namespace}/{pod}", "k8s", team, kept)
    return None


def synthetic_pid(workflow_id: str, uuid: str) -> int:
    digest = hashlib.sha1(f"{workflow_id}\0{uuid}".encode()).hexdigest()
    return PID_BASE + int(digest[:7], 16) % (1 << 29)


# ---------------------------------------------------------------------------------------------------- import


def _cursors(store: Store) -> dict[tuple[str, int], tuple[int, float | None]]:
    """{(host, index): (device id, time of its last sample)} of the devices earlier imports created.

    One index probe per device ((device_id, ts) index), never a scan of the sample table."""
    last = (select(func.max(DeviceSample.ts)).where(DeviceSample.device_id == Device.id)
            .correlate(Device).scalar_subquery())
    with store.session() as s:
        rows = s.execute(select(Device.host_id, Device.index, Device.id, last).where(Device.source == SOURCE)).all()
    return {(h, i): (d, None if t is None else float(t)) for h, i, d, t in rows}


def _last_counts(store: Store, cursors: dict[tuple[str, int], tuple[int, float | None]]) -> dict[int, tuple]:
    """{device id: (ecc_errors, xid_errors)} as stored at each device's last sample (counters carry on from there)."""
    wanted = [(d, t) for d, t in cursors.values() if t is not None]
    if not wanted:
        return {}
    with store.session() as s:
        rows = s.execute(
            select(DeviceSample.device_id, DeviceSample.ecc_errors, DeviceSample.xid_errors)
            .where(tuple_(DeviceSample.device_id, DeviceSample.ts).in_(wanted))
        ).all()
    return {d: (e, x) for d, e, x in rows}


PRIO = {f.name: i for i, f in enumerate(FIELDS)}
COLUMNS = ("gpu_util", "mem_util", "mem_used", "mem_free", "mem_reserved", "power_w", "temperature_c", "sm_clock_mhz",
           "throttle_reasons", "sm_active", "sm_occupancy", "tensor_active", "ecc_errors", "xid_code")


@dataclass
class _Parsed:
    """The fetched series by device: per device {column: (priority, times, values)} in the store's units, and per
    (device, workflow) the times that workflow's series have on it."""

    devices: list[DeviceKey] = field(default_factory=list)
    workflows: list[WorkflowKey] = field(default_factory=list)
    columns: list[dict[str, tuple[int, np.ndarray, np.ndarray]]] = field(default_factory=list)
    users: dict[tuple[int, int], list[np.ndarray]] = field(default_factory=dict)


def _parse(series: list[dict[str, Any]], settings: Settings, skipped: dict[str, set]) -> _Parsed:
    out = _Parsed()
    dev_index: dict[DeviceKey, int] = {}
    wf_index: dict[WorkflowKey, int] = {}
    for s in series:
        labels = s["metric"]
        name = labels.get("__name__", "")
        f = BY_NAME.get(name)
        points = s["values"]
        if f is None or not points:
            continue
        dev = device_of(labels)
        if isinstance(dev, str):
            skipped.setdefault(dev, set()).add(tuple(sorted(labels.items())))
            continue
        d = dev_index.get(dev)
        if d is None:
            d = dev_index[dev] = len(out.devices)
            out.devices.append(dev)
            out.columns.append({})
        ts = np.fromiter((p[0] for p in points), float, len(points))
        values = np.array([p[1] for p in points], dtype=float) * f.scale
        ok = np.isfinite(values)
        if not ok.all():
            ts, values = ts[ok], values[ok]
        prio = PRIO[name]
        have = out.columns[d].get(f.column)
        if have is None or prio < have[0]:
            out.columns[d][f.column] = (prio, ts, values)
        elif prio == have[0]:  # one GPU's series per pod using it: the same readings, maybe at other times
            both_ts, first = np.unique(np.concatenate([have[1], ts]), return_index=True)
            out.columns[d][f.column] = (prio, both_ts, np.concatenate([have[2], values])[first])
        wf = workflow_of(labels, settings)
        if wf is not None:
            w = wf_index.get(wf)
            if w is None:
                w = wf_index[wf] = len(out.workflows)
                out.workflows.append(wf)
            out.users.setdefault((d, w), []).append(ts)
    return out


def _wide(parsed: _Parsed) -> tuple[dict[str, np.ndarray], np.ndarray]:
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


def _counters(wide: dict[str, np.ndarray], offsets: np.ndarray, cursor: np.ndarray,
              last: dict[int, tuple[Any, Any]]) -> int:
    """ecc_errors made monotonic across resets, and xid_errors as a count of new XID codes, each carrying on from
    the device's last stored sample (`last`: dev -> stored (ecc, xid) at the cursor); returns the resets seen."""
    resets = 0
    ecc_all, code_all, ts_all = wide["ecc_errors"], wide["xid_code"], wide["ts"]
    xid_all = np.full(len(ts_all), np.nan)
    for d in range(len(offsets) - 1):
        lo, hi = int(offsets[d]), int(offsets[d + 1])
        stored_ecc, stored_xid = last.get(d, (None, None))
        old = ts_all[lo:hi] <= cursor[d]  # fetched again only to carry the counts on
        ecc = ecc_all[lo:hi]
        if np.isfinite(ecc).any():
            offset, prev = 0.0, None
            base = np.flatnonzero(old & np.isfinite(ecc))
            if len(base) and stored_ecc is not None:
                prev = float(ecc[base[-1]])
                offset = float(stored_ecc) - prev
            for i in np.flatnonzero(np.isfinite(ecc) & ~old):
                v = float(ecc[i])
                if prev is not None and v < prev:  # it dropped: the counter restarted from zero
                    offset += prev
                    resets += 1
                ecc[i] = offset + v
                prev = v
        codes = code_all[lo:hi]
        if np.isfinite(codes).any():
            base = np.flatnonzero(old & np.isfinite(codes))
            prev_code = float(codes[base[-1]]) if len(base) else 0.0
            count = int(stored_xid or 0)
            out = xid_all[lo:hi]
            for i in np.flatnonzero(np.isfinite(codes) & ~old):
                v = float(codes[i])
                if v != prev_code and v != 0:
                    count += 1
                out[i] = count
                prev_code = v
    wide["xid_errors"] = xid_all
    return resets


def _pylist(values: np.ndarray, integer: bool = False) -> list[Any]:
    """A column as Python values with NaN as None (and whole numbers as int where the store wants BIGINT)."""
    missing = np.isnan(values)
    if integer:
        out = np.rint(np.where(missing, 0, values)).astype(np.int64).astype(object)
    else:
        out = values.astype(object)
    if missing.any():
        out[missing] = None
    return out.tolist()


def import_prometheus(
    store: Store,
    url: str,
    *,
    since: float | None = None,
    until: float | None = None,
    step: float | None = None,
    settings: Settings | None = None,
    now: float | None = None,
) -> ImportSummary:
    """Import dcgm-exporter series of [since, until] at `step` s; see the module's doc for what is written.

    The range is read and written a window (FLEETLENS_PROMETHEUS_WINDOW_S) at a time, so a week of a large fleet
    never sits in memory at once; each window is written whole or not at all, and a failure in one leaves the
    windows before it, after which the next run resumes.
    """
    settings = settings or get_settings()
    started = time.perf_counter()
    step = float(step or settings.prometheus_step_s)
    if not step > 0:
        raise InvalidInput(f"the step must be a positive number of seconds, not {step}")
    now = time.time() if now is None else now
    until = float(until if until is not None else now - step)  # the newest step may still be being scraped
    known = [t for _, t in _cursors(store).values() if t is not None]
    if since is None:  # after the device that is furthest behind, but never further back than the look-back
        since = max(min(known), until - settings.prometheus_lookback_s) if known else \
            until - settings.prometheus_lookback_s
    if since > until:
        raise InvalidInput(f"--since ({since}) is after --until ({until}); nothing to import")
    # the grid is aligned to the step, so the same times come back every run; a device's last stored point is
    # fetched again (never written again) to carry its counters on
    start = math.floor(float(since) / step) * step
    window = max(step, math.floor(settings.prometheus_window_s / step) * step)
    summary = ImportSummary(url=url, since=start, until=until, step=step)
    seen: dict[str, Any] = {"hosts": set(), "devices": set(), "workflows": set(), "series": set(), "skipped": {}}
    windows = []
    lo = start
    while True:
        hi = min(until, lo + window)
        windows.append((lo, hi))
        if hi >= until:
            break
        lo = hi  # the boundary's point is fetched again: it carries the counters on
    names = [f.name for f in FIELDS]

    def fetch(lo: float, hi: float) -> list[dict[str, Any]]:
        t0 = time.perf_counter()
        series = client.fetch(names, lo, hi, step)
        summary.fetch_s += time.perf_counter() - t0
        return series

    # the next window is fetched while this one is written; each is written only once it is fetched whole
    with PrometheusClient(url, timeout_s=settings.prometheus_timeout_s) as client, \
            ThreadPoolExecutor(max_workers=1) as ahead:
        pending = ahead.submit(fetch, *windows[0])
        for i, (lo, _hi) in enumerate(windows):
            try:
                series = pending.result()
            except (UpstreamUnavailable, InvalidInput) as exc:
                if summary.device_samples:
                    raise type(exc)(f"{exc}. Before that, {summary.device_samples} device samples up to "
                                    f"{lo:.0f} were imported; the next run resumes there") from None
                raise
            if i + 1 < len(windows):
                pending = ahead.submit(fetch, *windows[i + 1])
            _import_window(store, client.url, series, settings, until, step, summary, seen)
    summary.hosts, summary.devices, summary.workflows, summary.series = (
        len(seen[k]) for k in ("hosts", "devices", "workflows", "series"))
    summary.skipped = {why: len(keys) for why, keys in seen["skipped"].items()}
    summary.seconds = time.perf_counter() - started
    if summary.skipped:
        log.warning("prometheus %s: %s", url, "; ".join(f"skipped {n} series {why}"
                                                      for why, n in sorted(summary.skipped.items())))
    log.info("prometheus %s: imported %s", url, summary.describe())
    return summary


def _import_window(store: Store, url: str, series: list[dict[str, Any]], settings: Settings, until: float,
                   step: float, summary: ImportSummary, seen: dict[str, Any]) -> None:
    """Write what is new in one window's series, in one go."""
    cursors = _cursors(store)
    # the same series come back in every window: count each once
    seen["series"].update(tuple(sorted(x["metric"].items())) for x in series)
    parsed = _parse(series, settings, seen["skipped"])
    del series
    if not parsed.devices:
        return
    wide, offsets = _wide(parsed)
    # where each device's series resumes
    cursor = np.array([(cursors.get((d.host, d.index)) or (None, None))[1] or -math.inf for d in parsed.devices])
    stored = _last_counts(store, cursors)
    last = {d: stored[cursors[(k.host, k.index)][0]] for d, k in enumerate(parsed.devices)
            if (k.host, k.index) in cursors and cursors[(k.host, k.index)][0] in stored}
    summary.counter_resets += _counters(wide, offsets, cursor, last)
    keep = wide["ts"] > cursor[wide["dev"]]
    if not keep.any():
        return
    procs = _processes(parsed, wide, offsets, cursor)
    device_ids = _register(store, url, parsed, wide, keep, procs, until, step, seen)
    dev_ids = np.array([device_ids.get((d.host, d.index), -1) for d in parsed.devices], dtype=np.int64)
    n_dev, n_proc = write_samples(store, _device_rows(wide, keep, dev_ids), _process_rows(procs, wide, dev_ids, parsed))
    summary.device_samples += n_dev
    summary.process_samples += n_proc


def _processes(parsed: _Parsed, wide: dict[str, np.ndarray], offsets: np.ndarray, cursor: np.ndarray
               ) -> dict[tuple[int, int], np.ndarray]:
    """{(dev, workflow): row numbers in `wide`} of the new samples each workflow's series have on each device."""
    out = {}
    for (d, w), times in parsed.users.items():
        ts = np.unique(np.concatenate(times))
        ts = ts[ts > cursor[d]]
        if len(ts):
            lo, hi = int(offsets[d]), int(offsets[d + 1])
            out[(d, w)] = lo + np.searchsorted(wide["ts"][lo:hi], ts)
    return out


def _device_rows(wide: dict[str, np.ndarray], keep: np.ndarray, dev_ids: np.ndarray) -> Iterable[tuple[Any, ...]]:
    if DEVICE_SAMPLE_COLUMNS != ("device_id", "ts", *SAMPLE_COLUMNS):
        raise RuntimeError("store.ingest's device sample columns changed; update the Prometheus importer")
    cols = [dev_ids[wide["dev"][keep]].tolist(), wide["ts"][keep].tolist()]
    cols += [_pylist(wide[c][keep], c in INT_COLUMNS) for c in SAMPLE_COLUMNS]
    return zip(*cols, strict=True)


def _process_rows(procs: dict[tuple[int, int], np.ndarray], wide: dict[str, np.ndarray], dev_ids: np.ndarray,
                  parsed: _Parsed) -> Iterable[tuple[Any, ...]]:
    """One process sample per new sample of a device a workflow uses: its memory and utilisation are the device's
    (dcgm-exporter's pod series carry the GPU's readings)."""
    if PROCESS_SAMPLE_COLUMNS != ("device_id", "workflow_id", "host_id", "pid", "ts", "mem_used", "sm_util",
                                  "cpu_util"):
        raise RuntimeError("store.ingest's process sample columns changed; update the Prometheus importer")
    if not procs:
        return iter(())
    keys = list(procs)
    rows = np.concatenate([procs[k] for k in keys])
    sizes = [len(procs[k]) for k in keys]

    def repeat(values: list[Any]) -> list[Any]:
        return np.repeat(np.array(values, dtype=object), sizes).tolist()

    return zip(
        repeat([int(dev_ids[d]) for d, _ in keys]), repeat([parsed.workflows[w].id for _, w in keys]),
        repeat([parsed.devices[d].host for d, _ in keys]),
        repeat([synthetic_pid(parsed.workflows[w].id, parsed.devices[d].uuid) for d, w in keys]),
        wide["ts"][rows].tolist(), _pylist(wide["mem_used"][rows], True), _pylist(wide["gpu_util"][rows]),
        [None] * len(rows), strict=True)


def _register(store: Store, url: str, parsed: _Parsed, wide: dict[str, np.ndarray], keep: np.ndarray,
              procs: dict[tuple[int, int], np.ndarray], until: float, step: float, seen: dict[str, Any]
              ) -> dict[tuple[str, int], int]:
    """Hosts, devices, workflows and their synthetic processes, in one transaction; {(host, index): device id}."""
    devs = wide["dev"][keep]
    used = sorted(set(devs.tolist()))
    totals = wide["mem_total"][keep]
    mem_total = {}
    for d in used:
        t = totals[devs == d]
        t = t[np.isfinite(t)]
        mem_total[d] = int(round(float(t.max()))) if len(t) else None
    ts = wide["ts"]
    span = {key: (float(ts[rows[0]]), float(ts[rows[-1]])) for key, rows in procs.items()}
    # a workflow whose series stopped before the imported range ends is over (two steps of slack for scrapes)
    ended_before = until - 2 * step
    device_ids: dict[tuple[str, int], int] = {}
    with store.session() as s:
        hosts = sorted({parsed.devices[d].host for d in used})
        known_devices = {(h, i): (d, u) for h, i, d, u in s.execute(
            select(Device.host_id, Device.index, Device.id, Device.uuid).where(Device.host_id.in_(hosts))).tuples()}
        known_hosts = set(s.scalars(select(Host.id).where(Host.id.in_(hosts))))
        for host in hosts:
            if host not in known_hosts:  # a host an agent registered keeps its own record
                register_host(s, host, hostname=host, source=SOURCE, labels={"imported_from": url}, now=until)
        by_host: dict[str, list[DeviceSpec]] = {}
        refresh = []
        for d in used:
            key = parsed.devices[d]
            known = known_devices.get((key.host, key.index))
            if known is not None and known[1] == key.uuid:  # imported before: only its last sighting moves on
                device_ids[(key.host, key.index)] = known[0]
                refresh.append({"id": known[0], "last_seen": until, "state": "ok"})
                continue
            by_host.setdefault(key.host, []).append(DeviceSpec(index=key.index, uuid=key.uuid, name=key.name,
                                                               memory_total=mem_total[d]))
        if refresh:
            s.execute(update(Device), refresh)
        for host, specs in by_host.items():
            for index, device_id in register_devices(s, host, specs, source=SOURCE, now=until).items():
                device_ids[(host, index)] = device_id
        seen_wf: dict[int, tuple[float, float]] = {}
        for (_d, w), (first, last) in span.items():
            lo, hi = seen_wf.get(w, (first, last))
            seen_wf[w] = (min(lo, first), max(hi, last))
        ids = [parsed.workflows[w].id for w in seen_wf]
        existing = {row.id: row for row in s.scalars(select(Workflow).where(Workflow.id.in_(ids)))}
        for w, (first, last) in seen_wf.items():
            wk = parsed.workflows[w]
            row = existing.get(wk.id)
            finished = last < ended_before
            if row is None:
                s.add(Workflow(id=wk.id, id_source=wk.id_source, name=dict(wk.labels).get(POD) or wk.id,
                               team=wk.team, labels={**dict(wk.labels), "imported_from": url}, created_at=first,
                               last_seen=last, state="finished" if finished else "running"))
                continue
            # a workflow an agent registered keeps how it was found and its team
            row.labels = {**(row.labels or {}), **dict(wk.labels), "imported_from": url}
            if row.team is None:
                row.team = wk.team
            row.created_at = min(row.created_at, first)
            if last >= row.last_seen:
                row.last_seen = last
                row.state = "finished" if finished else "running"
        s.flush()
        pids = {(d, w): synthetic_pid(parsed.workflows[w].id, parsed.devices[d].uuid) for d, w in span}
        known_procs = {(h, p, wf): i for i, h, p, wf in s.execute(
            select(Process.id, Process.host_id, Process.pid, Process.workflow_id)
            .where(Process.host_id.in_(hosts), Process.pid.in_(sorted(set(pids.values()))))).tuples()}
        new_rows, seen_again = [], []
        for (d, w), (first, last) in span.items():
            dk, wk = parsed.devices[d], parsed.workflows[w]
            ended = last + step if last < ended_before else None
            existing_id = known_procs.get((dk.host, pids[(d, w)], wk.id))
            if existing_id is None:
                new_rows.append({"host_id": dk.host, "pid": pids[(d, w)], "start_time": first, "workflow_id": wk.id,
                                 "cmdline": f"{wk.id} on {dk.uuid} (dcgm-exporter)", "username": None,
                                 "first_seen": first, "last_seen": last, "ended_at": ended})
            else:
                seen_again.append({"id": existing_id, "last_seen": last, "ended_at": ended})
        if new_rows:
            s.execute(insert(Process), new_rows)
        if seen_again:
            s.execute(update(Process), seen_again)
        seen["hosts"].update(hosts)
        seen["devices"].update((parsed.devices[d].host, parsed.devices[d].index) for d in used)
        seen["workflows"].update(parsed.workflows[w].id for w in seen_wf)
    return device_ids


def import_from_settings(store: Store, settings: Settings) -> dict[str, Any]:
    """The serve job and the DAG task: import from FLEETLENS_PROMETHEUS_URL since the last import."""
    if not settings.prometheus_url:
        return {"skipped": "FLEETLENS_PROMETHEUS_URL is not set"}
    summary = import_prometheus(store, settings.prometheus_url, settings=settings)
    return {"device_samples": summary.device_samples, "process_samples": summary.process_samples,
            "series": summary.series, "skipped": summary.skipped, "devices": summary.devices}


__all__ = ["ImportSummary", "PrometheusClient", "import_from_settings", "import_prometheus"]
