"""Import a fleet's dcgm-exporter telemetry from an existing Prometheus (HTTP API, query_range) into the store.

Every dcgm-exporter series is one GPU (or MIG instance) of one host, perhaps labelled with the pod, namespace and
container (or HPC job) using it. Its samples become device samples of that device, and, when a pod or job uses it,
process samples of that workflow (one synthetic process per workflow and device: dcgm-exporter does not see pids),
written through store.ingest.write_samples like an agent's.

Incremental and idempotent: a device's last sample in the store is where its series resumes; points at or before it
are never written again, so importing the same range twice writes nothing the second time. Everything is fetched
and checked before anything is written: Prometheus down, a wrong URL or an answer that is not Prometheus's raises
UpstreamUnavailable / InvalidInput with nothing written, and the next run fetches the same range again.
Series without a GPU label (gpu or UUID) or a host label (Hostname or instance) are skipped and counted. Gaps stay
gaps (query_range gives no point where Prometheus has no sample in its look-back). A counter that drops
(DCGM_FI_DEV_ECC_DBE_VOL_TOTAL after a driver reload) is read as a reset: the stored count keeps rising.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
import pandas as pd
from sqlalchemy import func, insert, select, update

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
from store.workflows import upsert_workflow

log = logging.getLogger(__name__)

SOURCE = "prometheus"
MAX_POINTS = 10_000  # Prometheus refuses a query_range of more than 11,000 points per series
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
            raise UpstreamUnavailable(f"Prometheus at {self.url} did not answer in time; nothing was imported, "
                                      "try again or raise FLEETLENS_PROMETHEUS_TIMEOUT_S") from None
        except httpx.HTTPError as exc:
            raise UpstreamUnavailable(f"Prometheus at {self.url} cannot be reached ({exc}); nothing was imported, "
                                      "check the URL and that Prometheus runs") from None
        try:
            body = resp.json()
        except ValueError:
            body = None
        if not isinstance(body, dict) or "status" not in body:
            raise InvalidInput(f"{self.url} answered HTTP {resp.status_code} without Prometheus's JSON to "
                               "/api/v1/query_range; is this the Prometheus server's base URL? nothing was imported")
        if body["status"] != "success":
            raise InvalidInput(f"Prometheus at {self.url} refused the query ({body.get('errorType')}: "
                               f"{body.get('error')}); nothing was imported")
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
        merged: dict[tuple[tuple[str, str], ...], dict[str, Any]] = {}
        for name in names:
            query = f"last_over_time({name}[{max(1, round(step * 1000) - 1)}ms])"
            t = start
            while t <= end:
                stop = min(end, t + chunk)
                for series in self.query_range(query, t, stop, step):
                    labels = {**series["metric"], "__name__": name}  # functions drop the metric's name
                    key = tuple(sorted(labels.items()))
                    if key in merged:
                        merged[key]["values"].extend(series["values"])
                    else:
                        merged[key] = {"metric": labels, "values": list(series["values"])}
                t = stop + step
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
    """{(host, index): (device id, time of its last sample)} of the devices earlier imports created."""
    with store.session() as s:
        last = (select(DeviceSample.device_id, func.max(DeviceSample.ts).label("ts"))
                .group_by(DeviceSample.device_id).subquery())
        rows = s.execute(
            select(Device.host_id, Device.index, Device.id, last.c.ts)
            .outerjoin(last, last.c.device_id == Device.id).where(Device.source == SOURCE)
        ).all()
    return {(h, i): (d, None if t is None else float(t)) for h, i, d, t in rows}


def _last_counts(store: Store, cursors: dict[tuple[str, int], tuple[int, float | None]]) -> dict[int, tuple]:
    """{device id: (ecc_errors, xid_errors)} as stored at each device's last sample (counters carry on from there)."""
    wanted = [(d, t) for d, t in cursors.values() if t is not None]
    if not wanted:
        return {}
    with store.session() as s:
        rows = s.execute(
            select(DeviceSample.device_id, DeviceSample.ts, DeviceSample.ecc_errors, DeviceSample.xid_errors)
            .where(DeviceSample.device_id.in_([d for d, _ in wanted]))
            .where(DeviceSample.ts >= min(t for _, t in wanted))
        ).all()
    at = dict(wanted)
    return {d: (e, x) for d, t, e, x in rows if t == at.get(d)}


def _long_frame(series: list[dict[str, Any]], settings: Settings, summary: ImportSummary
                ) -> tuple[pd.DataFrame, list[DeviceKey], list[WorkflowKey | None]]:
    """All points as one frame: dev (index into devices), wf (index into workflows, -1: none), col, ts, value."""
    devices: dict[DeviceKey, int] = {}
    workflows: dict[WorkflowKey | None, int] = {None: -1}
    wf_list: list[WorkflowKey | None] = []
    parts = []
    for s in series:
        labels = s["metric"]
        f = BY_NAME.get(labels.get("__name__", ""))
        if f is None or not s["values"]:
            continue
        dev = device_of(labels)
        if isinstance(dev, str):
            summary.skipped[dev] = summary.skipped.get(dev, 0) + 1
            continue
        wf = workflow_of(labels, settings)
        d = devices.setdefault(dev, len(devices))
        if wf not in workflows:
            workflows[wf] = len(wf_list)
            wf_list.append(wf)
        points = np.asarray(s["values"], dtype=object)
        ts = points[:, 0].astype(float)
        values = points[:, 1].astype(float) * f.scale
        ok = np.isfinite(values)
        n = int(ok.sum())
        parts.append(pd.DataFrame({"dev": np.full(n, d), "wf": np.full(n, workflows[wf]),
                                   "col": np.full(n, f.column, dtype=object), "prio": np.full(n, FIELDS.index(f)),
                                   "ts": ts[ok], "value": values[ok]}))
    frame = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(
        {"dev": [], "wf": [], "col": [], "prio": [], "ts": [], "value": []})
    return frame, list(devices), wf_list


def _device_frame(points: pd.DataFrame) -> pd.DataFrame:
    """One row per (dev, ts) with a column per sample field; a pod's series repeats its GPU's values, and when two
    fields fill one column the preferred one (see collector.dcgm_names.FIELDS) wins."""
    best = points.sort_values(["dev", "ts", "col", "prio"], kind="stable").drop_duplicates(["dev", "ts", "col"])
    wide = best.pivot(index=["dev", "ts"], columns="col", values="value")
    for col in ("gpu_util", "mem_util", "mem_used", "mem_free", "mem_reserved", "power_w", "temperature_c",
                "sm_clock_mhz", "throttle_reasons", "sm_active", "sm_occupancy", "tensor_active", "ecc_errors",
                "xid_code"):
        if col not in wide:
            wide[col] = np.nan
    wide["mem_total"] = wide["mem_used"] + wide["mem_free"] + wide["mem_reserved"].fillna(0.0)
    return wide.reset_index().sort_values(["dev", "ts"], kind="stable")


def _counters(wide: pd.DataFrame, prev: dict[int, tuple[float | None, float | None, float | None, float | None]]
              ) -> tuple[pd.DataFrame, int]:
    """ecc_errors made monotonic across resets and xid_errors as a count of new XID codes, continuing each device's
    stored counts; `prev` gives per dev (raw ecc, stored ecc, raw xid code, stored xid count) before the first row."""
    resets = 0
    ecc_out = np.full(len(wide), np.nan)
    xid_out = np.full(len(wide), np.nan)
    pos = 0
    for dev, group in wide.groupby("dev", sort=False):
        n = len(group)
        raw_prev, stored_prev, code_prev, count_prev = prev.get(int(dev), (None, None, None, None))
        ecc = group["ecc_errors"].to_numpy()
        if np.isfinite(ecc).any():
            offset = 0.0 if stored_prev is None or raw_prev is None else stored_prev - raw_prev
            last = raw_prev
            out = np.full(n, np.nan)
            for i, v in enumerate(ecc):
                if not math.isfinite(v):
                    continue
                if last is not None and v < last:  # dropped: the counter restarted from zero
                    offset += last
                    resets += 1
                out[i] = offset + v
                last = v
            ecc_out[pos:pos + n] = out
        codes = group["xid_code"].to_numpy()
        if np.isfinite(codes).any():
            count = count_prev or 0
            last = code_prev if code_prev is not None else 0.0
            out = np.full(n, np.nan)
            for i, v in enumerate(codes):
                if not math.isfinite(v):
                    continue
                if v != last and v != 0:
                    count += 1
                out[i] = count
                last = v
            xid_out[pos:pos + n] = out
        pos += n
    wide = wide.assign(ecc_errors=ecc_out, xid_errors=xid_out)
    return wide, resets


def _none(v: Any, integer: bool) -> Any:
    if v is None or v != v:
        return None
    return int(round(v)) if integer else float(v)


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
    """Import dcgm-exporter series of [since, until] at `step` s; see the module's doc for what is written."""
    settings = settings or get_settings()
    started = time.perf_counter()
    step = float(step or settings.prometheus_step_s)
    if not step > 0:
        raise InvalidInput(f"the step must be a positive number of seconds, not {step}")
    now = time.time() if now is None else now
    until = float(until if until is not None else now - step)  # the newest step may still be being scraped
    cursors = _cursors(store)
    known = [t for _, t in cursors.values() if t is not None]
    if since is None:
        since = min(known) if known else until - settings.prometheus_lookback_s
    if since > until:
        raise InvalidInput(f"--since ({since}) is after --until ({until}); nothing to import")
    # the grid is aligned to the step, so the same times come back every run; a device's last stored point is
    # fetched again (never written again) to carry its counters on
    start = math.floor(float(since) / step) * step
    summary = ImportSummary(url=url, since=start, until=until, step=step)
    with PrometheusClient(url, timeout_s=settings.prometheus_timeout_s) as client:
        fetched = time.perf_counter()
        series = client.fetch([f.name for f in FIELDS], start, until, step)
        summary.fetch_s = time.perf_counter() - fetched
    summary.series = len(series)
    points, devices, workflows = _long_frame(series, settings, summary)
    if summary.skipped:
        log.warning("prometheus %s: %s", url, "; ".join(f"skipped {n} series {why}"
                                                      for why, n in sorted(summary.skipped.items())))
    if points.empty:
        summary.seconds = time.perf_counter() - started
        return summary
    wide = _device_frame(points)
    # where each device's series resumes
    cursor = np.array([(cursors.get((d.host, d.index)) or (None, None))[1] or -math.inf for d in devices])
    last_counts = _last_counts(store, cursors)
    before = wide[wide["ts"].to_numpy() <= cursor[wide["dev"].to_numpy()]]
    prev: dict[int, tuple] = {}
    for dev, row in before.groupby("dev").tail(1).set_index("dev").iterrows():
        device_id = (cursors.get((devices[dev].host, devices[dev].index)) or (None, None))[0]
        ecc, xid = last_counts.get(device_id, (None, None))
        prev[int(dev)] = (_none(row["ecc_errors"], False), ecc, _none(row["xid_code"], False), xid)
    wide, summary.counter_resets = _counters(wide, prev)
    new = wide[wide["ts"].to_numpy() > cursor[wide["dev"].to_numpy()]]
    if new.empty:
        summary.seconds = time.perf_counter() - started
        return summary
    procs = points[points["wf"] >= 0][["dev", "wf", "ts"]].drop_duplicates()
    procs = procs[procs["ts"].to_numpy() > cursor[procs["dev"].to_numpy()]]
    procs = procs.merge(new[["dev", "ts", "mem_used", "gpu_util"]], on=["dev", "ts"], how="inner")

    device_ids = _register(store, url, devices, workflows, new, procs, until, step, summary)
    dev_ids = np.array([device_ids[(d.host, d.index)] for d in devices], dtype=np.int64)
    summary.device_samples, summary.process_samples = write_samples(
        store, _device_rows(new, dev_ids), _process_rows(procs, dev_ids, devices, workflows))
    summary.seconds = time.perf_counter() - started
    log.info("prometheus %s: imported %s", url, summary.describe())
    return summary


def _device_rows(new: pd.DataFrame, dev_ids: np.ndarray) -> list[tuple[Any, ...]]:
    cols: list[list[Any]] = [dev_ids[new["dev"].to_numpy()].tolist(), new["ts"].astype(float).tolist()]
    for col in SAMPLE_COLUMNS:
        values = new[col].to_numpy(dtype=float)
        if col in INT_COLUMNS:
            cols.append([None if v != v else int(round(v)) for v in values.tolist()])
        else:
            cols.append([None if v != v else v for v in values.tolist()])
    if DEVICE_SAMPLE_COLUMNS != ("device_id", "ts", *SAMPLE_COLUMNS):
        raise RuntimeError("store.ingest's device sample columns changed; update the Prometheus importer")
    return list(zip(*cols, strict=True))


def _process_rows(procs: pd.DataFrame, dev_ids: np.ndarray, devices: list[DeviceKey],
                  workflows: list[WorkflowKey | None]) -> list[tuple[Any, ...]]:
    if PROCESS_SAMPLE_COLUMNS != ("device_id", "workflow_id", "host_id", "pid", "ts", "mem_used", "sm_util",
                                  "cpu_util"):
        raise RuntimeError("store.ingest's process sample columns changed; update the Prometheus importer")
    rows = []
    for dev, wf, ts, mem, util in procs[["dev", "wf", "ts", "mem_used", "gpu_util"]].itertuples(index=False):
        d, w = devices[dev], workflows[wf]
        rows.append((int(dev_ids[dev]), w.id, d.host, synthetic_pid(w.id, d.uuid), float(ts),
                     None if mem != mem else int(round(mem)), None if util != util else float(util), None))
    return rows


def _register(store: Store, url: str, devices: list[DeviceKey], workflows: list[WorkflowKey | None],
              new: pd.DataFrame, procs: pd.DataFrame, until: float, step: float, summary: ImportSummary
              ) -> dict[tuple[str, int], int]:
    """Hosts, devices, workflows and their synthetic processes, in one transaction; {(host, index): device id}."""
    used = sorted(set(new["dev"].tolist()))
    mem_total = new.groupby("dev")["mem_total"].max()
    span = procs.groupby(["dev", "wf"])["ts"].agg(["min", "max"]) if len(procs) else None
    # a workflow whose series stopped before the imported range ends is over (two steps of slack for scrapes)
    ended_before = until - 2 * step
    device_ids: dict[tuple[str, int], int] = {}
    with store.session() as s:
        hosts = sorted({devices[d].host for d in used})
        for host in hosts:
            if s.get(Host, host) is None:  # a host an agent registered keeps its own record
                register_host(s, host, hostname=host, source=SOURCE, labels={"imported_from": url}, now=until)
        by_host: dict[str, list[DeviceSpec]] = {}
        for d in used:
            key = devices[d]
            total = mem_total.get(d)
            by_host.setdefault(key.host, []).append(DeviceSpec(
                index=key.index, uuid=key.uuid, name=key.name,
                memory_total=None if total is None or total != total else int(round(total))))
        for host, specs in by_host.items():
            for index, device_id in register_devices(s, host, specs, source=SOURCE, now=until).items():
                device_ids[(host, index)] = device_id
        seen_wf: dict[int, tuple[float, float]] = {}
        if span is not None:
            for (_dev, wf), (first, last) in span.iterrows():
                lo, hi = seen_wf.get(wf, (first, last))
                seen_wf[wf] = (min(lo, first), max(hi, last))
        for wf, (first, last) in seen_wf.items():
            w = workflows[wf]
            row = s.get(Workflow, w.id)
            finished = last < ended_before
            labels = {**(row.labels if row is not None else {}), **dict(w.labels), "imported_from": url}
            # a workflow an agent registered keeps how it was found and its team
            fields = {"labels": labels} if row is not None else {
                "labels": labels, "id_source": w.id_source, "name": dict(w.labels).get(POD) or w.id}
            if row is None or row.team is None:
                fields["team"] = w.team
            wf_row = upsert_workflow(s, w.id, now=first, **fields)
            wf_row.created_at = min(wf_row.created_at, first)
            wf_row.last_seen = max(row.last_seen if row is not None else last, last)
            wf_row.state = "finished" if finished and wf_row.last_seen <= last else "running"
        if span is not None:
            for (dev, wf), (first, last) in span.iterrows():
                d, w = devices[dev], workflows[wf]
                pid = synthetic_pid(w.id, d.uuid)
                ended = last + step if last < ended_before else None
                existing = s.scalar(select(Process.id).where(Process.host_id == d.host, Process.pid == pid,
                                                             Process.workflow_id == w.id))
                if existing is None:
                    s.execute(insert(Process), [{
                        "host_id": d.host, "pid": pid, "start_time": float(first), "workflow_id": w.id,
                        "cmdline": f"{w.id} on {d.uuid} (dcgm-exporter)", "username": None,
                        "first_seen": float(first), "last_seen": float(last), "ended_at": ended}])
                else:
                    s.execute(update(Process).where(Process.id == existing)
                              .values(last_seen=float(last), ended_at=ended))
        summary.hosts, summary.devices, summary.workflows = len(hosts), len(used), len(seen_wf)
    return device_ids


def import_from_settings(store: Store, settings: Settings) -> dict[str, Any]:
    """The serve job and the DAG task: import from FLEETLENS_PROMETHEUS_URL since the last import."""
    if not settings.prometheus_url:
        return {"skipped": "FLEETLENS_PROMETHEUS_URL is not set"}
    summary = import_prometheus(store, settings.prometheus_url, settings=settings)
    return {"device_samples": summary.device_samples, "process_samples": summary.process_samples,
            "series": summary.series, "skipped": summary.skipped, "devices": summary.devices}


__all__ = ["ImportSummary", "PrometheusClient", "import_from_settings", "import_prometheus"]
