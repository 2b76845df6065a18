"""Import a fleet's dcgm-exporter telemetry from an existing Prometheus (HTTP API, query_range) into the store.

Every dcgm-exporter series is one GPU (or MIG instance) of one host, perhaps labelled with the pod, namespace and
container (or HPC job) using it. Its samples become device samples of that device, and, when a pod or job uses it,
process samples of that workflow (one synthetic process per workflow and device: dcgm-exporter does not see pids),
written through store.ingest (write_sample_batches_on: the same COPY as an agent's write_samples).

Incremental and idempotent: a device's last sample in the store (on a GPU an agent also reports, maybe the agent's:
dcgm-exporter's points then fill in only after it) is where its series resumes; points at or before it are never
written again, so importing the same range twice writes nothing the second time. The range is taken a window at a
time (FLEETLENS_PROMETHEUS_WINDOW_S, 6 h), in a pipeline: the next window is fetched while this one is turned into
column batches and the ones before are written; only the fields that have series in the range are asked for,
uncompressed (FLEETLENS_PROMETHEUS_COMPRESS), with Python's cyclic collector paused. A window is fetched and checked
whole before any of it is written, then written in one transaction (its hosts, devices, workflows and processes with
its samples). On PostgreSQL two windows are written at once on two connections (the database's COPY work is most of
an import), and still committed in order: a window's samples are copied while the window before it commits, and its
registration and commit wait for that commit, so a window is never in the store without every window before it.
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

from collector.dcgm_names import DEVICE_WORKFLOW, FIELDS, LEGACY
from collector.importers.dcgm_frames import (
    Carried,
    counters,
    parse,
    processes,
    wide_columns,
)
from collector.importers.dcgm_labels import SOURCE
from collector.importers.prometheus_http import PrometheusClient
from collector.importers.prometheus_write import Registered, Turn, Window, write_window
from store.db import Store
from store.errors import DatabaseUnavailable, InvalidInput, UpstreamUnavailable
from store.models import Device, DeviceSample
from store.run_locks import single_run
from store.settings import Settings

log = logging.getLogger(__name__)


class NoDcgmSeries(InvalidInput):
    """The Prometheus asked has no series under any dcgm-exporter name fleetlens reads, in the range asked."""


class ImportRunning(InvalidInput):
    """Another import from Prometheus writes into the same database now (one at a time: store.run_locks)."""


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



def _cursors(store: Store) -> tuple[dict[tuple[str, int], tuple[int, float | None]], list[float]]:
    """{(host, index): (device id, time of its last sample)} of every device in the store, and the last sample times
    of those earlier imports created.

    Every device, not only imported ones: a GPU whose host also runs an agent is the agent's device, which the import
    writes into; its series resume after its last sample whoever wrote it, or each run would write them again. Where
    an import with no --since starts is read from the imported devices alone (an agent's device that stopped
    reporting must not pull every run back to the look-back). One index probe per device ((device_id, ts) index),
    never a scan of the sample table."""
    last = (select(func.max(DeviceSample.ts)).where(DeviceSample.device_id == Device.id)
            .correlate(Device).scalar_subquery())
    with store.session() as s:
        rows = s.execute(select(Device.host_id, Device.index, Device.id, Device.source, last)).all()
    cursors = {(h, i): (d, None if t is None else float(t)) for h, i, d, _, t in rows}
    return cursors, [float(t) for _, _, _, source, t in rows if source == SOURCE and t is not None]


def _resume_points(store: Store, cursors: dict[tuple[str, int], tuple[int, float | None]]
                   ) -> dict[tuple[str, int], tuple[float, Carried]]:
    """{(host, index): (time, counters)} of each imported device's last stored sample: where its series resumes
    and where its counters carry on from."""
    wanted = {(d, t): key for key, (d, t) in cursors.items() if t is not None}
    if not wanted:
        return {}
    with store.session() as s:
        rows = s.execute(
            select(DeviceSample.device_id, DeviceSample.ts, DeviceSample.ecc_errors, DeviceSample.xid_errors)
            .where(tuple_(DeviceSample.device_id, DeviceSample.ts).in_(list(wanted)))
        ).all()
    return {wanted[(d, t)]: (float(t), Carried(ecc=None if e is None else float(e), xid=x))
            for d, t, e, x in rows}


LATEST_SECONDS = 1e11  # epoch seconds of the year 5138: a larger time is in milliseconds (or finer)


def _seconds(name: str, value: float | None) -> None:
    """Refuse a time given in epoch milliseconds (Grafana's URLs and many exporters carry them): taken as seconds it is
    thousands of years away, and a range up to it is millions of windows to fetch."""
    if value is not None and abs(float(value)) >= LATEST_SECONDS:
        raise InvalidInput(f"{name} {value:.0f} is in milliseconds, not epoch seconds: give {float(value) / 1000:.0f}")


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
    windows before it, after which the next run resumes. One import at a time writes into a database: another one
    running raises ImportRunning.
    """
    with cyclic_gc_paused(), single_run(store, "prometheus-import") as mine:
        if not mine:  # two runs would both write what neither had found in the store yet
            raise ImportRunning("another import from Prometheus is writing into this database (fleetlens serve's, "
                                "the Airflow DAG's or a `fleetlens import-prometheus`); run this one when it has "
                                "ended: it resumes where that one stopped")
        return _import(store, url, since=since, until=until, step=step, settings=settings, now=now)


def _import(store: Store, url: str, *, since: float | None, until: float | None, step: float | None,
            settings: Settings, now: float | None) -> ImportSummary:
    started = time.perf_counter()
    step = float(step or settings.prometheus_step_s)
    if not step > 0:
        raise InvalidInput(f"the step must be a positive number of seconds, not {step}")
    now = time.time() if now is None else now
    for name, value in (("--since", since), ("--until", until)):
        _seconds(name, value)
    until = float(until if until is not None else now - step)  # the newest step may still be being scraped
    cursors, known = _cursors(store)
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
    registry = Registered()
    with PrometheusClient(url, timeout_s=settings.prometheus_timeout_s,
                          compress=settings.prometheus_compress) as client, \
            ThreadPoolExecutor(max_workers=1) as ahead, ThreadPoolExecutor(max_workers=writers) as writer:
        # only the metrics that have series in the range: most fleets export a few of dcgm-exporter's fields, and
        # asking for each of the others every window was a fifth of the fetch
        names = client.names_present(names, start, until)
        if not any(n in FIELD_NAMES for n in names):
            raise _nothing_to_import(client, start, until)
        pending = ahead.submit(fetch, *windows[0])
        writing: list[Future] = []  # in window order
        last_turn: Turn | None = None
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
                turn = last_turn = Turn(last_turn)
                writing.append(writer.submit(write_window, store, client.url, plan, until, step, seen, hi,
                                             registry, turn))
        for job in writing:
            written(job)
        written_to[0] = until
    summary.hosts, summary.devices, summary.workflows, summary.series = (
        len(seen[k]) for k in ("hosts", "devices", "workflows", "series"))
    summary.skipped = {why: len(keys) for why, keys in seen["skipped"].items()}
    # by the series fetched: a server that does not list names (names_present) gets every name asked for
    legacy = sorted({dict(key).get("__name__") for key in seen["series"]} & LEGACY)
    if legacy:
        log.warning("prometheus %s: read dcgm-exporter 1.x's names (%s)", url, ", ".join(legacy))
    summary.seconds = time.perf_counter() - started
    if summary.skipped:
        log.warning("prometheus %s: %s", url, "; ".join(f"skipped {n} series {why}"
                                                      for why, n in sorted(summary.skipped.items())))
    log.info("prometheus %s: imported %s", url, summary.describe())
    return summary


def _plan_window(series: list[dict[str, Any]], settings: Settings,
                 resume: dict[tuple[str, int], tuple[float, Carried]], summary: ImportSummary,
                 seen: dict[str, Any]) -> Window | None:
    """What is new in one window's series (None: nothing); `resume` moves on to the window's last new samples."""
    # the same series come back in every window: count each once
    seen["series"].update(tuple(sorted(x["metric"].items())) for x in series)
    parsed = parse(series, settings, seen["skipped"])
    if not parsed.devices:
        return None
    wide, offsets = wide_columns(parsed)
    points = [resume.get((d.host, d.index)) for d in parsed.devices]
    cursor = np.array([-math.inf if p is None else p[0] for p in points])
    carried = {d: p[1] for d, p in enumerate(points) if p is not None}
    resets, after = counters(wide, offsets, cursor, carried)
    summary.counter_resets += resets
    keep = wide["ts"] > cursor[wide["dev"]]
    if not keep.any():
        return None
    procs = processes(parsed, wide, offsets, cursor)
    for d, key in enumerate(parsed.devices):
        lo, hi = int(offsets[d]), int(offsets[d + 1])
        rows = np.flatnonzero(keep[lo:hi])
        if len(rows):
            resume[(key.host, key.index)] = (float(wide["ts"][lo + int(rows[-1])]), after[d])
    return Window(parsed, wide, keep, procs)


FIELD_NAMES = frozenset(f.name for f in FIELDS)
WRITERS = 2  # windows written at once on PostgreSQL, each on its own connection


def import_from_settings(store: Store, settings: Settings) -> dict[str, Any]:
    """The serve job and the DAG task: import from FLEETLENS_PROMETHEUS_URL since the last import."""
    if not settings.prometheus_url:
        return {"skipped": "FLEETLENS_PROMETHEUS_URL is not set"}
    try:
        summary = import_prometheus(store, settings.prometheus_url, settings=settings)
    except ImportRunning as exc:  # the next scheduled run resumes after that one
        log.info("prometheus %s: %s", settings.prometheus_url, exc)
        return {"skipped": str(exc)}
    return {"device_samples": summary.device_samples, "process_samples": summary.process_samples,
            "series": summary.series, "skipped": summary.skipped, "devices": summary.devices}


__all__ = ["ImportRunning", "ImportSummary", "NoDcgmSeries", "PrometheusClient", "cyclic_gc_paused",
           "import_from_settings", "import_prometheus", "import_windows"]
