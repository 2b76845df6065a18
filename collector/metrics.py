"""The agent's /metrics (prometheus_client): its latest readings under dcgm-exporter's names, plus fleetlens's own.

Per device, one series of each DCGM_FI_* gauge in dcgm-exporter's units and labels (gpu, UUID, device, modelName,
hostname; and fleetlens's host), so a Grafana board made for dcgm-exporter works on fleetlens hosts. Which workflows
use a device is apart: fleetlens_device_workflow, 1 per (device, workflow), labelled workflow, team, pod and
namespace (join on host and gpu), so a device's readings are never repeated once per workflow. Per process, the
fleetlens_process_* gauges (dcgm-exporter has no per-process readings). And what only fleetlens knows: lane
membership, the lane gate's waiting jobs and turns, the spool's depth, migrations touching this host by state.

A scrape reads what the sampler took last (it never calls the device source); what comes from the store (teams,
pod labels, lanes, migrations) is re-read at most every `refresh_s`, and a store that is away leaves the last
known values in place. Formatting some 600 labelled lines is most of a scrape's cost, so the formatted answer is
kept until something in it can have changed (a new sample, a store refresh, the spool's depth, the lane gate's
queue): scrapers that come more often than the sampler (or several Prometheus replicas) get it ready-made.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector
from sqlalchemy import func, or_, select

from collector.dcgm_names import BY_NAME, MIB
from collector.sources.base import DeviceInfo, DeviceReading
from store.errors import ConfigError, FleetlensError
from store.models import Action, Device, Lane, Placement, Workflow

log = logging.getLogger(__name__)

# dcgm-exporter's own label names, kept so that its Grafana boards and recording rules read fleetlens hosts unchanged:
# `promtool check metrics` asks for snake_case and flags `modelName`, which is dcgm-exporter's name for the model (every
# board built for it groups by modelName); `hostname` is its name since its 2026 rename (Hostname before)
DEVICE_LABELS = ["gpu", "UUID", "device", "modelName", "hostname", "host"]
OWN_DEVICE_LABELS = ["gpu", "UUID", "device", "hostname", "host"]  # fleetlens's own device series: snake_case
USER_LABELS = ["gpu", "UUID", "hostname", "host", "workflow", "team", "pod", "namespace"]
PROCESS_LABELS = ["gpu", "UUID", "host", "pid", "workflow", "team", "pod", "namespace"]  # fleetlens's own names
# sample field -> (dcgm-exporter name, factor from the store's unit to dcgm-exporter's)
EXPORTED: tuple[tuple[str, str, float], ...] = (
    ("gpu_util", "DCGM_FI_DEV_GPU_UTIL", 100.0),
    ("mem_util", "DCGM_FI_DEV_MEM_COPY_UTIL", 100.0),
    ("mem_used", "DCGM_FI_DEV_FB_USED", 1.0 / MIB),
    ("power_w", "DCGM_FI_DEV_POWER_USAGE", 1.0),
    ("temperature_c", "DCGM_FI_DEV_GPU_TEMP", 1.0),
    ("sm_clock_mhz", "DCGM_FI_DEV_SM_CLOCK", 1.0),
    ("throttle_reasons", "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", 1.0),
    ("sm_active", "DCGM_FI_PROF_SM_ACTIVE", 1.0),
    ("sm_occupancy", "DCGM_FI_PROF_SM_OCCUPANCY", 1.0),
    ("tensor_active", "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", 1.0),
)


class AgentMetrics(Collector):
    """A prometheus_client collector over one agent (collector.agent.Agent)."""

    def __init__(self, agent: Any, *, refresh_s: float = 30.0) -> None:
        self.agent = agent
        self.refresh_s = refresh_s
        self._infos: dict[int, DeviceInfo] = {}
        self._meta: dict[str, tuple[str, str, str]] = {}  # workflow -> (team, pod, namespace)
        self._lanes: list[tuple[str, str, str, str]] = []  # (lane, gpu, UUID, workflow)
        self._migrations: dict[str, int] = {}
        self._read_at = -float("inf")
        self._version = 0  # moves on whenever what came from the store changed
        self._lock = threading.Lock()

    # ---- what comes from the store, cached -----------------------------------------------------------------

    def _refresh(self, workflows: set[str]) -> None:
        now = time.monotonic()
        if now - self._read_at < self.refresh_s and workflows <= self._meta.keys():
            return
        self._read_at = now
        try:
            with self.agent.store.session() as s:
                rows = s.execute(select(Workflow.id, Workflow.team, Workflow.labels)
                                 .where(Workflow.id.in_(sorted(workflows)))).all() if workflows else []
                device_ids = list(self.agent._device_ids.values())
                lanes = s.execute(
                    select(Placement.lane_id, Device.index, Device.uuid, Placement.workflow_id)
                    .join(Device, Device.id == Placement.device_id)
                    .join(Lane, Lane.id == Placement.lane_id)
                    .where(Placement.state == "active", Device.host_id == self.agent.host_id)
                ).all()
                migrations = s.execute(
                    select(Action.state, func.count()).where(or_(Action.from_device_id.in_(device_ids),
                                                                 Action.to_device_id.in_(device_ids)))
                    .group_by(Action.state)
                ).all() if device_ids else []
        except FleetlensError as exc:  # the store is away: keep serving what is known
            log.debug("metrics: store unavailable (%s)", exc)
            return
        for wf, team, labels in rows:
            labels = labels or {}
            self._meta[wf] = (team or "", str(labels.get("pod", "")), str(labels.get("namespace", "")))
        for wf in workflows - self._meta.keys():
            self._meta[wf] = ("", "", "")
        self._lanes = [(str(lane), str(index), uuid, wf) for lane, index, uuid, wf in lanes]
        self._migrations = {state: int(n) for state, n in migrations}
        self._version += 1

    def state(self) -> Hashable:
        """What the exposition depends on, cheap to take: equal states give the same exposition."""
        gate = getattr(getattr(self.agent, "sdk_handler", None), "gate", None)
        queues = tuple(sorted((str(name), len(st.get("waiting", ())), st.get("turns", 0))
                              for name, st in gate.snapshot().items())) if gate is not None and hasattr(
            gate, "snapshot") else ()
        due = time.monotonic() - self._read_at >= self.refresh_s
        # the readings list itself (compared by identity: the sampler puts a new one in place each round)
        return _Same(self.agent.latest), self._version, due, len(self.agent.spool), queues

    def _info(self, index: int) -> DeviceInfo | None:
        if index not in self._infos:
            self._infos = {d.index: d for d in self.agent.source.devices()}
        return self._infos.get(index)

    # ---- the scrape ------------------------------------------------------------------------------------------

    def collect(self) -> Iterator[Metric]:
        readings: list[DeviceReading] = list(self.agent.latest)
        procs = self.agent._procs.known
        host = self.agent.host_id
        with self._lock:
            self._refresh({procs[p.pid].workflow_id for r in readings for p in r.processes if p.pid in procs})
        device = {name: GaugeMetricFamily(name, BY_NAME[name].help, labels=DEVICE_LABELS) for _, name, _ in EXPORTED}
        free = GaugeMetricFamily("DCGM_FI_DEV_FB_FREE", BY_NAME["DCGM_FI_DEV_FB_FREE"].help, labels=DEVICE_LABELS)
        # a gauge: prometheus_client would rename a counter to ..._VOL_total, not dcgm-exporter's ..._VOL_TOTAL
        ecc = GaugeMetricFamily("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", BY_NAME["DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"].help,
                                labels=DEVICE_LABELS)
        xid = CounterMetricFamily("fleetlens_xid_errors", "XID error events seen since the agent started.",
                                  labels=OWN_DEVICE_LABELS)
        p_mem = GaugeMetricFamily("fleetlens_process_gpu_memory_used_bytes", "GPU memory a process uses (bytes).",
                                  labels=PROCESS_LABELS)
        p_sm = GaugeMetricFamily("fleetlens_process_sm_util_ratio", "Fraction of time a process ran kernels (0..1).",
                                 labels=PROCESS_LABELS)
        used_by = GaugeMetricFamily("fleetlens_device_workflow", "1 for each workflow using a device (join the "
                                    "device's DCGM_FI_* series on host and gpu).", labels=USER_LABELS)
        for r in readings:
            info = self._info(r.index)
            uuid, model = (info.uuid, info.name) if info is not None else ("", "")
            gpu = str(r.index)
            users: dict[str, tuple[str, str, str]] = {}
            for p in r.processes:
                proc = procs.get(p.pid)
                wf = proc.workflow_id if proc is not None else ""
                team, pod, ns = self._meta.get(wf, ("", "", ""))
                users.setdefault(wf, (team, pod, ns))
                plabels = [gpu, uuid, host, str(p.pid), wf, team, pod, ns]
                if p.mem_used is not None:
                    p_mem.add_metric(plabels, float(p.mem_used))
                if p.sm_util is not None:
                    p_sm.add_metric(plabels, float(p.sm_util))
            for wf, (team, pod, ns) in users.items():
                if not wf:  # a process no workflow was found for
                    continue
                used_by.add_metric([gpu, uuid, host, host, wf, team, pod, ns], 1.0)
            labels = [gpu, uuid, f"nvidia{r.index}", model, host, host]
            for field, name, scale in EXPORTED:
                value = getattr(r, field)
                if value is not None:
                    device[name].add_metric(labels, float(value) * scale)
            if r.mem_used is not None and r.mem_total is not None:
                free.add_metric(labels, (r.mem_total - r.mem_used) / MIB)
            if r.ecc_errors is not None:
                ecc.add_metric(labels, float(r.ecc_errors))
            if r.xid_errors is not None:
                xid.add_metric([gpu, uuid, f"nvidia{r.index}", host, host], float(r.xid_errors))
        yield from device.values()
        yield from (free, ecc, xid, used_by, p_mem, p_sm)
        yield from self._own(host)

    def _own(self, host: str) -> Iterator[Metric]:
        lane = GaugeMetricFamily("fleetlens_lane_member", "1 for each workflow placed in a lane of this host's GPUs.",
                                 labels=["host", "lane", "gpu", "UUID", "workflow"])
        for lane_id, gpu, uuid, wf in self._lanes:
            lane.add_metric([host, lane_id, gpu, uuid, wf], 1.0)
        yield lane
        waiting = GaugeMetricFamily("fleetlens_gate_waiting_jobs", "Jobs waiting for their lane's turn.",
                                    labels=["host", "lane"])
        turns = CounterMetricFamily("fleetlens_gate_turns", "Turns the lane gate granted.", labels=["host", "lane"])
        gate = getattr(getattr(self.agent, "sdk_handler", None), "gate", None)
        if gate is not None and hasattr(gate, "snapshot"):
            for name, state in gate.snapshot().items():
                waiting.add_metric([host, str(name)], float(len(state.get("waiting", ()))))
                turns.add_metric([host, str(name)], float(state.get("turns", 0)))
        yield waiting
        yield turns
        spool = GaugeMetricFamily("fleetlens_spool_batches", "Sample batches spooled while the database is away.",
                                  labels=["host"])
        spool.add_metric([host], float(len(self.agent.spool)))
        yield spool
        migrations = GaugeMetricFamily("fleetlens_migrations", "Migrations from or to this host's GPUs, by state.",
                                       labels=["host", "state"])
        for state, n in sorted(self._migrations.items()):
            migrations.add_metric([host, state], float(n))
        yield migrations


class _Same:
    """Equal only to itself wrapping the same object (keeps it alive, so its id is never reused meanwhile)."""

    __slots__ = ("obj",)

    def __init__(self, obj: object) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


class CachedExposition:
    """A WSGI app: prometheus_client's own /metrics app, its answers kept while `state()` stays the same.

    An answer is kept per request shape (format asked for, compression, name[] filter), so Prometheus's
    OpenMetrics and a curl's text each come back as prometheus_client would make them."""

    def __init__(self, registry: CollectorRegistry, state: Callable[[], Hashable]) -> None:
        self._app = make_wsgi_app(registry)
        self._state = state
        self._lock = threading.Lock()
        self._kept: tuple[Hashable, dict[tuple[str, ...], tuple[str, list[tuple[str, str]], bytes]]] = (None, {})
        self.renders = 0  # answers made rather than reused

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        shape = tuple(str(environ.get(k, "")) for k in ("PATH_INFO", "QUERY_STRING", "HTTP_ACCEPT",
                                                        "HTTP_ACCEPT_ENCODING", "REQUEST_METHOD"))
        with self._lock:  # one render at a time: concurrent scrapes of a new sample wait for the first one's
            state = self._state()
            kept_state, answers = self._kept
            if kept_state != state:
                answers = {}
                self._kept = (state, answers)
            if shape not in answers:
                made: dict[str, Any] = {}

                def keep(status: str, headers: list[tuple[str, str]], *_: Any) -> None:
                    made["status"], made["headers"] = status, headers

                body = b"".join(self._app(environ, keep))
                self.renders += 1
                answers[shape] = (made["status"], made["headers"], body)
            status, headers, body = answers[shape]
        start_response(status, list(headers))
        return [body]


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        """Scrapes are not worth a log line each."""


def serve_agent_metrics(agent: Any, port: int, *, addr: str = "") -> tuple[Any, CollectorRegistry]:
    """Serve the agent's /metrics on `addr`:`port` ("": every interface, as dcgm-exporter's :9400) in a daemon thread;
    returns (server, registry); server.shutdown() stops. A port that cannot be listened on raises ConfigError."""
    registry = CollectorRegistry(auto_describe=False)
    collector = AgentMetrics(agent)
    registry.register(collector)
    try:
        server = make_server(addr, port, CachedExposition(registry, collector.state), ThreadingWSGIServer,
                             handler_class=_QuietHandler)
    except OSError as exc:  # most often dcgm-exporter, whose port (9400) this is by default
        raise ConfigError(f"cannot serve /metrics on {addr or '*'}:{port} ({exc.strerror or exc}): is dcgm-exporter "
                          "or another agent listening there? Choose another port with --listen-address or "
                          "FLEETLENS_METRICS_PORT") from None
    threading.Thread(target=server.serve_forever, name="fleetlens-metrics", daemon=True).start()
    return server, registry


__all__ = ["AgentMetrics", "CachedExposition", "serve_agent_metrics"]
