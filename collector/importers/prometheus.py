"""Import a fleet's dcgm-exporter telemetry from an existing Prometheus (HTTP API, query_range) into the store.

Every dcgm-exporter series is one GPU (or MIG instance) of one host, perhaps labelled with the pod, namespace and
container (or HPC job) using it. Its samples become device samples of that device, and, when a pod or job uses it,
process samples of that workflow (one synthetic process per workflow and device: dcgm-exporter does not see pids),
written through store.ingest (write_sample_batches_on: the same COPY as an agent's write_samples).

Incremental and idempotent: a device's last sample in the store is where its series resumes; points at or before it
are never written again, so importing the same range twice writes nothing the second time. The range is taken a
window at a time (FLEETLENS_PROMETHEUS_WINDOW_S, 6 h), in a pipeline: the next window is fetched while this one is
turned into column batches and the ones before are written; only the fields that have series in the range are asked
for, uncompressed (FLEETLENS_PROMETHEUS_COMPRESS), with Python's cyclic collector paused. A window is fetched and
checked whole before any of it is written, then written in one transaction (its hosts, devices, workflows and
processes with its samples). On PostgreSQL two windows are written at once on two connections (the database's COPY
work is most of an import), and still committed in order: a window's samples are copied while the window before
it commits, and its registration and commit wait for that commit, so a window is never in the store without every
window before it.
Prometheus down, a wrong URL or an answer that is not Prometheus's raises
UpstreamUnavailable / InvalidInput naming what was imported before (nothing, when the first window fails), and the
next run resumes after it. A Prometheus with none of the names in the range (no dcgm-exporter, or one that writes
names this importer does not know) raises NoDcgmSeries naming the DCGM-like metrics it has instead. Labels are read
as dcgm-exporter wrote them (collector.importers.dcgm_labels: today's and older host labels, kube-prometheus's
exported_* renaming). Series without a GPU label (gpu or UUID) or a host label (hostname, Hostname or instance) are
skipped and counted. Gaps stay gaps: each point is the last scrape in its step, never an older one. A counter that
drops (DCGM_FI_DEV_ECC_DBE_VOL_TOTAL after a driver reload) is read as a reset: the stored count keeps rising.
"""

from __future__ import annotations

import gc
import logging
import math
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from sqlalchemy import func, select, tuple_
from sqlalchemy.orm import Session

from collector.dcgm_names import DEVICE_WORKFLOW, FIELDS, LEGACY, POD
from collector.importers.dcgm_frames import (
    Parsed,
    counters,
    device_batch,
    parse,
    process_batch,
    processes,
    wide_columns,
)
from collector.importers.dcgm_labels import SOURCE, synthetic_pid
from collector.importers.prometheus_http import PrometheusClient
from store.db import Store
from store.errors import DatabaseUnavailable, InvalidInput, UpstreamUnavailable
from store.ingest import sample_errors, write_sample_batches_on
from store.models import Device, DeviceSample, Host, Process, Workflow
from store.registry import (
    DeviceSpec,
    add_hosts,
    add_processes,
    add_workflows,
    refresh_devices,
    refresh_processes,
    refresh_workflows,
    register_devices_of_hosts,
)
from store.settings import Settings

log = logging.getLogger(__name__)


class NoDcgmSeries(InvalidInput):
    """The Prometheus asked has no series under any dcgm-exporter name fleetlens reads, in the range asked."""


def _nothing_to_import(client: PrometheusClient, start: float, until: float) -> NoDcgmSeries:
    """What to say when no dcgm-exporter name has series: the DCGM-like names there are, if any."""
    like = client.names_like("(?i).*dcgm.*", start, until)
    where = f"Prometheus at {client.url} has no dcgm-exporter series between {start:.0f} and {until:.0f}"
    known = ("fleetlens reads dcgm-exporter's DCGM_FI_* names (and dcgm-exporter 1.x's dcgm_gpu_utilization, "
             "dcgm_fb_used, ...)")
    if like:
        shown = ", ".join(like[:12]) + (f" and {len(like) - 12} more" if len(like) > 12 else "")
        return NoDcgmSeries(f"{where}; its DCGM-like metrics are {shown}, none of which {known[:-1]}. "
                            "Relabel them to dcgm-exporter's names, or widen --since if they are older")
    return NoDcgmSeries(f"{where}, nor any metric named like DCGM: is dcgm-exporter scraped by this Prometheus "
                        f"(and is the range right: --since/--until)? {known}")


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



def _cursors(store: Store) -> dict[tuple[str, int], tuple[int, float | None]]:
    """{(host, index): (device id, time of its last sample)} of the devices earlier imports created.

    One index probe per device ((device_id, ts) index), never a scan of the sample table."""
    last = (select(func.max(DeviceSample.ts)).where(DeviceSample.device_id == Device.id)
            .correlate(Device).scalar_subquery())
    with store.session() as s:
        rows = s.execute(select(Device.host_id, Device.index, Device.id, last).where(Device.source == SOURCE)).all()
    return {(h, i): (d, None if t is None else float(t)) for h, i, d, t in rows}


def _resume_points(store: Store, cursors: dict[tuple[str, int], tuple[int, float | None]]
                   ) -> dict[tuple[str, int], tuple[float, Any, Any]]:
    """{(host, index): (time, ecc_errors, xid_errors)} of each imported device's last stored sample: where its
    series resumes and where its counters carry on from."""
    wanted = {(d, t): key for key, (d, t) in cursors.items() if t is not None}
    if not wanted:
        return {}
    with store.session() as s:
        rows = s.execute(
            select(DeviceSample.device_id, DeviceSample.ts, DeviceSample.ecc_errors, DeviceSample.xid_errors)
            .where(tuple_(DeviceSample.device_id, DeviceSample.ts).in_(list(wanted)))
        ).all()
    return {wanted[(d, t)]: (float(t), e, x) for d, t, e, x in rows}


def import_windows(since: float, until: float, step: float, settings: Settings) -> list[tuple[float, float]]:
    """The [start, end] windows an import of [since, until] fetches and writes one at a time, in order.

    The grid is aligned to the step, so the same times come back every run; each window starts where the one
    before ends: the boundary's point is fetched again (never written again) to carry the counters on."""
    start = math.floor(float(since) / step) * step
    window = max(step, math.floor(settings.prometheus_window_s / step) * step)
    windows = []
    lo = start
    while True:
        hi = min(until, lo + window)
        windows.append((lo, hi))
        if hi >= until:
            return windows
        lo = hi


_gc_lock = threading.Lock()
_gc_paused = [0, False]  # imports running in this process, and whether the collector ran before the first


@contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while an import runs (on again after the last one, if it was on).

    A window's decoded JSON is hundreds of thousands of small lists: every few hundred of them the collector walks
    the young objects, and often enough the whole heap; in a process that holds much
    (the benchmark's recording, serve's state) that took more time than decoding itself (orjson.loads of a day: 14 ms
    without it, 264 ms with it). The importer makes no reference cycles; objects are freed by their counts as usual,
    and any cycles other threads make meanwhile are collected once the import ends."""
    with _gc_lock:
        if _gc_paused[0] == 0:
            _gc_paused[1] = gc.isenabled()
            gc.disable()
        _gc_paused[0] += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_paused[0] -= 1
            if _gc_paused[0] == 0 and _gc_paused[1]:
                gc.enable()


def import_prometheus(
    store: Store,
    url: str,
    *,
    since: float | None = None,
    until: float | None = None,
    step: float | None = None,
    settings: Settings,
    now: float | None = None,
) -> ImportSummary:
    """Import dcgm-exporter series of [since, until] at `step` s; see the module's doc for what is written.

    The range is read and written a window (FLEETLENS_PROMETHEUS_WINDOW_S) at a time, so a week of a large fleet
    never sits in memory at once; each window is written whole or not at all, and a failure in one leaves the
    windows before it, after which the next run resumes.
    """
    with cyclic_gc_paused():
        return _import(store, url, since=since, until=until, step=step, settings=settings, now=now)


def _import(store: Store, url: str, *, since: float | None, until: float | None, step: float | None,
            settings: Settings, now: float | None) -> ImportSummary:
    started = time.perf_counter()
    step = float(step or settings.prometheus_step_s)
    if not step > 0:
        raise InvalidInput(f"the step must be a positive number of seconds, not {step}")
    now = time.time() if now is None else now
    until = float(until if until is not None else now - step)  # the newest step may still be being scraped
    cursors = _cursors(store)
    known = [t for _, t in cursors.values() if t is not None]
    if since is None:  # after the device that is furthest behind, but never further back than the look-back
        since = max(min(known), until - settings.prometheus_lookback_s) if known else \
            until - settings.prometheus_lookback_s
    if since > until:
        raise InvalidInput(f"--since ({since}) is after --until ({until}); nothing to import")
    # the grid is aligned to the step, so the same times come back every run; a device's last stored point is
    # fetched again (never written again) to carry its counters on
    windows = import_windows(since, until, step, settings)
    start = windows[0][0]
    summary = ImportSummary(url=url, since=start, until=until, step=step)
    seen: dict[str, Any] = {"hosts": set(), "devices": set(), "workflows": set(), "series": set(), "skipped": {}}
    names = [f.name for f in FIELDS] + [DEVICE_WORKFLOW]
    # where each device resumes, read once: later windows resume where the window before them ends
    resume = _resume_points(store, cursors)
    written_to = [start]  # the start of the first window not written yet

    def fetch(lo: float, hi: float) -> list[dict[str, Any]]:
        t0 = time.perf_counter()
        series = client.fetch(names, lo, hi, step)
        summary.fetch_s += time.perf_counter() - t0
        return series

    def before(exc: Exception) -> Exception:
        if not summary.device_samples:
            return exc
        return type(exc)(f"{exc}. Before that, {summary.device_samples} device samples up to {written_to[0]:.0f} "
                         "were imported; the next run resumes there")

    def written(job: Future | None) -> None:
        if job is None:
            return
        try:
            n_dev, n_proc, hi = job.result()
        except (DatabaseUnavailable, InvalidInput) as exc:
            raise before(exc) from None
        summary.device_samples += n_dev
        summary.process_samples += n_proc
        written_to[0] = hi

    # fetching (Prometheus and JSON decoding), turning into rows (numpy) and writing (the database's COPY) overlap;
    # one window fetched ahead, WRITERS written at once and one more queued to be written as soon as one of them is
    # done (so the next window is planned meanwhile, not after), so memory stays bounded by a few windows.
    # SQLite has one writer at a time: there the windows are written one after another
    writers = WRITERS if store.is_postgres else 1
    registry = _Registered()
    with PrometheusClient(url, timeout_s=settings.prometheus_timeout_s,
                          compress=settings.prometheus_compress) as client, \
            ThreadPoolExecutor(max_workers=1) as ahead, ThreadPoolExecutor(max_workers=writers) as writer:
        # only the metrics that have series in the range: most fleets export a few of dcgm-exporter's fields, and
        # asking for each of the others every window was a fifth of the fetch
        names = client.names_present(names, start, until)
        if not any(n in FIELD_NAMES for n in names):
            raise _nothing_to_import(client, start, until)
        if any(n in LEGACY for n in names):
            log.warning("prometheus %s: reading dcgm-exporter 1.x's names (%s)", url,
                        ", ".join(n for n in names if n in LEGACY))
        pending = ahead.submit(fetch, *windows[0])
        writing: list[Future] = []  # in window order
        last_turn: _Turn | None = None
        for i, (_lo, hi) in enumerate(windows):
            try:
                series = pending.result()
            except (UpstreamUnavailable, InvalidInput) as exc:
                for job in writing:
                    written(job)
                raise before(exc) from None
            if i + 1 < len(windows):
                pending = ahead.submit(fetch, *windows[i + 1])
            plan = _plan_window(series, settings, resume, summary, seen)
            del series
            while len(writing) > writers:  # WRITERS being written and one waiting its turn in the writers' queue
                written(writing.pop(0))
            if plan is not None:
                turn = last_turn = _Turn(last_turn)
                writing.append(writer.submit(_write_window, store, client.url, plan, until, step, seen, hi,
                                             registry, turn))
        for job in writing:
            written(job)
        written_to[0] = until
    summary.hosts, summary.devices, summary.workflows, summary.series = (
        len(seen[k]) for k in ("hosts", "devices", "workflows", "series"))
    summary.skipped = {why: len(keys) for why, keys in seen["skipped"].items()}
    summary.seconds = time.perf_counter() - started
    if summary.skipped:
        log.warning("prometheus %s: %s", url, "; ".join(f"skipped {n} series {why}"
                                                      for why, n in sorted(summary.skipped.items())))
    log.info("prometheus %s: imported %s", url, summary.describe())
    return summary


@dataclass
class _Window:
    """One window's new samples, ready to write."""

    parsed: Parsed
    wide: dict[str, np.ndarray]
    keep: np.ndarray
    procs: dict[tuple[int, int], np.ndarray]


def _plan_window(series: list[dict[str, Any]], settings: Settings,
                 resume: dict[tuple[str, int], tuple[float, Any, Any]], summary: ImportSummary,
                 seen: dict[str, Any]) -> _Window | None:
    """What is new in one window's series (None: nothing); `resume` moves on to the window's last new samples."""
    # the same series come back in every window: count each once
    seen["series"].update(tuple(sorted(x["metric"].items())) for x in series)
    parsed = parse(series, settings, seen["skipped"])
    if not parsed.devices:
        return None
    wide, offsets = wide_columns(parsed)
    points = [resume.get((d.host, d.index)) for d in parsed.devices]
    cursor = np.array([-math.inf if p is None else p[0] for p in points])
    last = {d: (p[1], p[2]) for d, p in enumerate(points) if p is not None}
    summary.counter_resets += counters(wide, offsets, cursor, last)
    keep = wide["ts"] > cursor[wide["dev"]]
    if not keep.any():
        return None
    procs = processes(parsed, wide, offsets, cursor)
    for d, key in enumerate(parsed.devices):
        lo, hi = int(offsets[d]), int(offsets[d + 1])
        rows = np.flatnonzero(keep[lo:hi])
        if len(rows):
            r = lo + int(rows[-1])
            resume[(key.host, key.index)] = (float(wide["ts"][r]), _scalar(wide["ecc_errors"][r]),
                                             _scalar(wide["xid_errors"][r]))
    return _Window(parsed, wide, keep, procs)


def _scalar(value: float) -> int | None:
    return None if not np.isfinite(value) else int(round(float(value)))


FIELD_NAMES = frozenset(f.name for f in FIELDS)
WRITERS = 2  # windows written at once on PostgreSQL, each on its own connection


class _Turn:
    """A window's place in the write order: its own futures (its new devices registered, its transaction
    committed), which the window after it waits for, and those of the window before it (None for the first)."""

    def __init__(self, before: _Turn | None) -> None:
        self.before_registered = None if before is None else before.registered
        self.before_committed = None if before is None else before.committed
        self.registered: Future = Future()
        self.committed: Future = Future()

    def settle(self, exc: BaseException | None) -> None:
        for done in (self.registered, self.committed):
            if not done.done():
                if exc is None:
                    done.set_result(None)
                else:
                    done.set_exception(exc)


class _EarlierWindowFailed(Exception):
    """The window before this one was not written; this one is rolled back (the caller reports the first)."""


@dataclass
class _Registered:
    """Hosts and devices windows of this import inserted, committed or not: what a later window must not insert
    again while the one that did has not committed yet. Only the window whose turn it is to register touches it."""

    hosts: set[str] = field(default_factory=set)
    devices: dict[tuple[str, int], int] = field(default_factory=dict)


def _wait(before: Future | None) -> None:
    if before is None:
        return
    try:
        before.result()
    except Exception:
        raise _EarlierWindowFailed() from None


def _write_window(store: Store, url: str, w: _Window, until: float, step: float, seen: dict[str, Any],
                  hi: float, registry: _Registered, turn: _Turn) -> tuple[int, int, float]:
    """One window in one transaction: its new hosts and devices (after the window before has inserted its own),
    its samples (while the window before may still be writing), then, once the window before has committed, the
    rest of its registration (devices seen again, workflows, processes) and its commit; (device samples, process
    samples, the window's end)."""
    error: BaseException | None = None
    try:
        with sample_errors(store), store.session() as s:
            mem_total = _memory_totals(w.wide, w.keep)
            _wait(turn.before_registered)
            device_ids = _add_new_devices(s, url, w.parsed, mem_total, until, registry)
            turn.registered.set_result(None)
            dev_ids = np.array([device_ids.get((d.host, d.index), -1) for d in w.parsed.devices], dtype=np.int64)
            n_dev, n_proc = write_sample_batches_on(s.connection(), store.is_postgres,
                                                    device_batch(w.wide, w.keep, dev_ids),
                                                    process_batch(w.procs, w.wide, dev_ids, w.parsed))
            _wait(turn.before_committed)
            _register(s, url, w.parsed, mem_total, w.wide, w.procs, until, step, seen)
        return n_dev, n_proc, hi
    except BaseException as exc:
        error = exc
        raise
    finally:
        turn.settle(error)


def _memory_totals(wide: dict[str, np.ndarray], keep: np.ndarray) -> dict[int, int | None]:
    """{dev: the largest total memory its new samples report} of every device with new samples."""
    devs = wide["dev"][keep]
    totals = wide["mem_total"][keep]
    mem_total = {}
    for d in sorted(set(devs.tolist())):
        t = totals[devs == d]
        t = t[np.isfinite(t)]
        mem_total[d] = int(round(float(t.max()))) if len(t) else None
    return mem_total


def _add_new_devices(s: Session, url: str, parsed: Parsed, mem_total: dict[int, int | None], until: float,
                     registry: _Registered) -> dict[tuple[str, int], int]:
    """Insert the hosts and devices with new samples that neither the store nor an earlier window of this
    import has, in the caller's transaction; {(host, index): device id} of every device with new samples.

    Only inserts: rows the store has are left to _register, which runs after the window before has committed and
    so never waits on its locks. `mem_total`: _memory_totals of the window."""
    wanted = {(parsed.devices[d].host, parsed.devices[d].index): d for d in mem_total}
    ids = {key: registry.devices[key] for key in wanted if key in registry.devices}
    hosts = sorted({h for h, _ in wanted if h not in registry.hosts})
    if hosts:
        # a host an agent registered keeps its own record
        known_hosts = set(s.scalars(select(Host.id).where(Host.id.in_(hosts))))
        add_hosts(s, [h for h in hosts if h not in known_hosts], source=SOURCE, labels={"imported_from": url},
                  now=until)
        registry.hosts.update(hosts)
    missing = [key for key in wanted if key not in ids]
    if missing:
        ids.update({(h, i): d for h, i, d in s.execute(
            select(Device.host_id, Device.index, Device.id)
            .where(Device.host_id.in_(sorted({h for h, _ in missing})))).tuples() if (h, i) in wanted})
        by_host: dict[str, list[DeviceSpec]] = {}
        for key in missing:
            if key not in ids:
                dk = parsed.devices[wanted[key]]
                by_host.setdefault(dk.host, []).append(DeviceSpec(index=dk.index, uuid=dk.uuid, name=dk.name,
                                                                  memory_total=mem_total[wanted[key]]))
        ids.update(register_devices_of_hosts(s, by_host, source=SOURCE, now=until))
        registry.devices.update({key: ids[key] for key in missing})
    return ids


def _register(s: Session, url: str, parsed: Parsed, mem_total: dict[int, int | None], wide: dict[str, np.ndarray],
              procs: dict[tuple[int, int], np.ndarray], until: float, step: float, seen: dict[str, Any]) -> None:
    """Devices seen again (their last sighting, or a new UUID at the same place), workflows and their synthetic
    processes, in the caller's transaction, after _add_new_devices (`mem_total`: _memory_totals of the window)."""
    used = sorted(mem_total)
    ts = wide["ts"]
    span = {key: (float(ts[rows[0]]), float(ts[rows[-1]])) for key, rows in procs.items()}
    # a workflow whose series stopped before the imported range ends is over (two steps of slack for scrapes)
    ended_before = until - 2 * step
    hosts = sorted({parsed.devices[d].host for d in used})
    known_devices = {(h, i): (d, u) for h, i, d, u in s.execute(
        select(Device.host_id, Device.index, Device.id, Device.uuid).where(Device.host_id.in_(hosts))).tuples()}
    by_host: dict[str, list[DeviceSpec]] = {}
    refresh = []
    for d in used:
        key = parsed.devices[d]
        known = known_devices.get((key.host, key.index))
        if known is not None and known[1] == key.uuid:  # imported before: only its last sighting moves on
            refresh.append({"id": known[0], "last_seen": until, "state": "ok"})
            continue
        by_host.setdefault(key.host, []).append(DeviceSpec(index=key.index, uuid=key.uuid, name=key.name,
                                                           memory_total=mem_total[d]))
    refresh_devices(s, refresh)
    register_devices_of_hosts(s, by_host, source=SOURCE, now=until)
    seen_wf: dict[int, tuple[float, float]] = {}
    devices_of: dict[int, set[int]] = {}  # a job on two MIG slices holds two devices, not one
    for (d, w), (first, last) in span.items():
        lo, hi = seen_wf.get(w, (first, last))
        seen_wf[w] = (min(lo, first), max(hi, last))
        devices_of.setdefault(w, set()).add(d)
    ids = [parsed.workflows[w].id for w in seen_wf]
    existing = {row.id: row for row in s.execute(
        select(Workflow.id, Workflow.team, Workflow.labels, Workflow.created_at, Workflow.last_seen, Workflow.gpus)
        .where(Workflow.id.in_(ids)))}
    new_wf, changed_wf = [], []  # written in two statements (executemany), not one per workflow
    for w, (first, last) in seen_wf.items():
        wk = parsed.workflows[w]
        row = existing.get(wk.id)
        state = "finished" if last < ended_before else "running"
        if row is None:
            new_wf.append({"id": wk.id, "id_source": wk.id_source, "name": dict(wk.labels).get(POD) or wk.id,
                           "team": wk.team, "labels": {**dict(wk.labels), "imported_from": url},
                           "created_at": first, "last_seen": last, "state": state, "gpus": len(devices_of[w])})
            continue
        # a workflow an agent registered keeps how it was found and its team
        change = {"id": wk.id, "labels": {**(row.labels or {}), **dict(wk.labels), "imported_from": url},
                  "team": wk.team if row.team is None else row.team, "created_at": min(row.created_at, first),
                  "gpus": max(row.gpus or 0, len(devices_of[w]))}
        if last >= row.last_seen:
            change.update(last_seen=last, state=state)
        changed_wf.append(change)
    add_workflows(s, new_wf)
    refresh_workflows(s, changed_wf)
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
    add_processes(s, new_rows)
    refresh_processes(s, seen_again)
    seen["hosts"].update(hosts)
    seen["devices"].update((parsed.devices[d].host, parsed.devices[d].index) for d in used)
    seen["workflows"].update(parsed.workflows[w].id for w in seen_wf)


def import_from_settings(store: Store, settings: Settings) -> dict[str, Any]:
    """The serve job and the DAG task: import from FLEETLENS_PROMETHEUS_URL since the last import."""
    if not settings.prometheus_url:
        return {"skipped": "FLEETLENS_PROMETHEUS_URL is not set"}
    summary = import_prometheus(store, settings.prometheus_url, settings=settings)
    return {"device_samples": summary.device_samples, "process_samples": summary.process_samples,
            "series": summary.series, "skipped": summary.skipped, "devices": summary.devices}


__all__ = ["ImportSummary", "NoDcgmSeries", "PrometheusClient", "cyclic_gc_paused", "import_from_settings",
           "import_prometheus", "import_windows"]
