"""The fleet-level Prometheus exporter (`fleetlens metrics-serve`): what the analyzer and the enforcer know.

Recoverable GPUs per workflow, team and rule (open findings; a workflow's overlapping findings on one device counted
once, as the ranking does): GPU-seconds per second, the base unit `promtool check metrics` asks for; times 24 it is
the GPU-hours per day `fleetlens rank` shows, open findings by severity and rule, and the devices the fleet holds,
the devices the last plan says it needs, and the devices that plan frees. The store is re-read at most every
`refresh_s` per scrape; a store that is away leaves the last values (and fleetlens_store_up 0).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import distinct, func, select

from analyzer.ranking import costed, findings_frame, rank_with_waste, teams_of
from store.db import Store
from store.errors import ConfigError, FleetlensError
from store.models import Action, Plan, ProcessSample
from store.settings import Settings

log = logging.getLogger(__name__)

HOURS_PER_DAY = 24.0
HELD_WINDOW_S = 900.0  # a device is held when some workflow had a process sample on it this recently


class FleetMetrics(Collector):
    def __init__(self, store: Store, *, refresh_s: float = 30.0, clock=time.time) -> None:
        self.store, self.refresh_s, self.clock = store, refresh_s, clock
        self._metrics: list[Metric] = []
        self._read_at = -float("inf")
        self._up = 0.0
        self._lock = threading.Lock()

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            if time.monotonic() - self._read_at >= self.refresh_s:
                try:
                    self._metrics = self._read()
                    self._up = 1.0
                except FleetlensError as exc:
                    log.warning("fleet metrics: the store cannot be read (%s); serving the last values", exc)
                    self._up = 0.0
                self._read_at = time.monotonic()
            up = GaugeMetricFamily("fleetlens_store_up", "1 when the last read of the fleetlens store worked.")
            up.add_metric([], self._up)
            return iter([*self._metrics, up])

    def _read(self) -> list[Metric]:
        # Every figure comes from the one waste function (through the ranking): overlapping findings on a device are
        # counted once and no total exceeds the GPU-hours held.
        ranked, w = rank_with_waste(self.store, now=self.clock())
        findings = findings_frame(self.store)
        open_ = findings[findings["status"] == "open"] if not findings.empty else findings
        by_rule = GaugeMetricFamily("fleetlens_recoverable_gpus",
                                    "GPUs open findings could give back (GPU-seconds per second; x 24: GPU-hours per "
                                    "day), per workflow, team and rule (each finding's cost from the waste function; "
                                    "rules of one device overlap).", labels=["workflow", "team", "rule"])
        by_wf = GaugeMetricFamily("fleetlens_workflow_recoverable_gpus",
                                  "GPUs a workflow could give back (GPU-seconds per second; overlapping findings "
                                  "counted once).", labels=["workflow", "team"])
        by_team = GaugeMetricFamily("fleetlens_team_recoverable_gpus",
                                    "GPUs a team could give back (GPU-seconds per second).", labels=["team"])
        severity = GaugeMetricFamily("fleetlens_open_findings", "Open findings, by severity and rule.",
                                     labels=["severity", "rule"])
        if not open_.empty:
            f = costed(findings, w)
            f = f[f["status"] == "open"].assign(team=lambda x: x["team"].fillna(""))
            sums = f.groupby(["workflow_id", "team", "rule"])["gpu_hours_per_day"].sum()
            for (wf, team, rule), hours in sums.items():
                by_rule.add_metric([wf, team, rule], float(hours) / HOURS_PER_DAY)
            for (sev, rule), n in f.groupby(["severity", "rule"]).size().items():
                severity.add_metric([sev, rule], float(n))
        flagged = ranked[ranked["open_findings"] > 0].assign(team=lambda x: x["team"].fillna(""))
        for _, row in flagged.iterrows():
            by_wf.add_metric([str(row["workflow_id"]), str(row["team"])],
                             float(row["recoverable_gpu_hours_per_day"]) / HOURS_PER_DAY)
        for _, row in teams_of(ranked).iterrows():
            by_team.add_metric([str(row["team"])], float(row["recoverable_gpu_hours_per_day"]) / HOURS_PER_DAY)
        devices = GaugeMetricFamily("fleetlens_devices", "Devices the fleet holds, needs after the last plan's moves, "
                                    "and frees with them.", labels=["state"])
        plan_ts = GaugeMetricFamily("fleetlens_last_plan_timestamp_seconds", "When the last plan was made.")
        migrations = GaugeMetricFamily("fleetlens_migrations", "Migrations by state.", labels=["state"])
        now = self.clock()
        with self.store.session() as s:
            held = s.scalar(select(func.count(distinct(ProcessSample.device_id)))
                            .where(ProcessSample.ts >= now - HELD_WINDOW_S)) or 0
            plan = s.execute(select(Plan.created_at, Plan.devices_freed).order_by(Plan.created_at.desc()).limit(1)
                             ).first()
            by_state = s.execute(select(Action.state, func.count()).group_by(Action.state)).all()
        freed = int(plan[1]) if plan is not None else 0
        devices.add_metric(["held"], float(held))
        devices.add_metric(["needed"], float(max(held - freed, 0)))
        devices.add_metric(["freed"], float(freed))
        if plan is not None:
            plan_ts.add_metric([], float(plan[0]))
        for state, n in by_state:
            migrations.add_metric([state], float(n))
        return [by_rule, by_wf, by_team, severity, devices, plan_ts, migrations]


def fleet_registry(store: Store, settings: Settings) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FleetMetrics(store, refresh_s=settings.metrics_serve_refresh_s))
    return registry


def serve_fleet_metrics(store: Store, settings: Settings, *, port: int, duration: float | None = None,
                        addr: str = "") -> None:
    """Serve /metrics on `addr`:`port` ("": every interface) until Ctrl-C / SIGTERM (or `duration` seconds). A port
    that cannot be listened on raises ConfigError."""
    try:
        server, _ = start_http_server(port, addr=addr or "0.0.0.0", registry=fleet_registry(store, settings))
    except OSError as exc:  # another exporter (or an earlier metrics-serve) holds the port
        raise ConfigError(f"cannot serve /metrics on {addr or '*'}:{port} ({exc.strerror or exc}): is another "
                          "exporter or metrics-serve listening there? Choose another with --port or "
                          "--listen-address") from None
    try:
        deadline = None if duration is None else time.monotonic() + duration
        while deadline is None or time.monotonic() < deadline:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
        server.server_close()


__all__ = ["FleetMetrics", "fleet_registry", "serve_fleet_metrics"]
