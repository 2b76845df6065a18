"""The dashboard's read-only queries: one function per view, each a SQL aggregate returned as a DataFrame or dict.

Windows longer than RAW_LIMIT_S read the hourly rollups the analyzer writes, never raw samples, so a week of a
thousand devices stays a few hundred thousand rows. Nothing here writes; state changes live in ui.dashboard.actions.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import pandas as pd
from sqlalchemy import Integer, and_, case, cast, func, select
from sqlalchemy.sql import ColumnElement, Select

from analyzer.device_hours import device_hours, rolled_device_hours
from analyzer.ranking import costed
from analyzer.waste import Waste, held_from_rollups, waste
from store.db import Store
from store.models import (
    Action,
    ActionEvent,
    Device,
    DeviceSample,
    Finding,
    Host,
    HostEvent,
    Lane,
    Placement,
    Plan,
    Rollup,
    Workflow,
)
from store.registry import hosts_heard_from, hosts_left_alone
from store.serving import AppWindow, app_windows
from store.serving_raw import all_raw_counts
from store.settings import get_settings
from store.sweeps import events as sweep_event_rows
from store.sweeps import gpu_use, labelled_trials
from store.sweeps import sweeps as sweep_rows

RAW_LIMIT_S = 6 * 3600  # longer windows read rollups
HOUR = 3600.0
HOST_NOT_HEARD_FROM = "not heard from"  # a host's status (hosts()): the enforcer moves nothing onto or off it
HOST_CLOSED = "takes no new job"  # a Slurm node drained, draining, in maintenance or reserved: nothing moves onto it


@dataclass(frozen=True)
class Window:
    """A time range [start, end) in epoch seconds; hashable so st.cache_data can key on it."""

    start: float
    end: float

    @classmethod
    def last(cls, seconds: float, now: float | None = None, align_s: float = 60.0) -> Window:
        # Align the end so reruns within the same minute hit the cache.
        now = time.time() if now is None else now
        end = (now // align_s + 1) * align_s
        return cls(end - seconds, end)

    @property
    def seconds(self) -> float:
        return self.end - self.start

    @property
    def uses_rollups(self) -> bool:
        return self.seconds > RAW_LIMIT_S

    @property
    def bucket_s(self) -> int:
        """Chart resolution: about 120 points per series on raw samples; an hour on rollups."""
        if self.uses_rollups:
            return 3600
        return max(60, int(self.seconds // 120 // 60 * 60))


def _frame(store: Store, stmt: Select) -> pd.DataFrame:
    with store.session() as session:
        return pd.read_sql(stmt, session.connection())


def _bucket(store: Store, ts: ColumnElement, seconds: int) -> ColumnElement:
    if store.is_postgres:
        return func.floor(ts / seconds) * seconds
    return cast(ts / seconds, Integer) * seconds


# ---------------------------------------------------------------- store state


def store_state(store: Store) -> dict[str, int]:
    """Counts that decide whether there is anything to show (empty store) and what the header says."""
    with store.session() as session:
        def count(model: Any) -> int:
            return int(session.scalar(select(func.count()).select_from(model)) or 0)

        has_samples = session.scalar(select(DeviceSample.ts).limit(1)) is not None
        has_rollups = session.scalar(select(Rollup.id).limit(1)) is not None
        newest_hour = session.scalar(select(func.max(Rollup.hour)).where(Rollup.scope == "device"))
        return {
            "hosts": count(Host),
            "devices": count(Device),
            "workflows": count(Workflow),
            "has_samples": int(has_samples),
            "has_rollups": int(has_rollups),
            # the end of the newest hour rolled up: long windows show nothing after it (0: none yet)
            "rolled_up_to": int(newest_hour + HOUR) if newest_hour is not None else 0,
        }


# ---------------------------------------------------------------- fleet


def fleet_hours(store: Store, window: Window) -> dict[str, float]:
    """Device-hours held (a job holds the device) and active (held x utilisation) in the window.

    Both are the analyzer's figures: long windows sum the hourly rollups it wrote; short (raw) windows add its
    rollup function over the raw samples of the hours not rolled up (analyzer.device_hours).
    """
    if window.uses_rollups:
        return rolled_device_hours(store, window.start, window.end)
    return device_hours(store, window.start, window.end)


def fleet_timeline(store: Store, window: Window) -> pd.DataFrame:
    """Devices held and devices active on average per time bucket (columns t, held, active).

    On rollups an hour's device-hours are exactly that hour's mean device count. On raw samples the chart
    shows the samples themselves: devices with memory in use, and the sum of their utilisation.
    """
    if window.uses_rollups:
        stmt = (
            select(
                Rollup.hour.label("t"),
                func.sum(Rollup.gpu_hours_held).label("held"),
                func.sum(Rollup.gpu_hours_active).label("active"),
            )
            .where(Rollup.scope == "device", Rollup.hour >= window.start, Rollup.hour < window.end)
            .group_by(Rollup.hour)
            .order_by(Rollup.hour)
        )
        return _frame(store, stmt)
    s = DeviceSample
    bucket = _bucket(store, s.ts, window.bucket_s).label("t")
    per_device = (
        select(
            bucket,
            s.device_id,
            func.avg(case((s.mem_used > 0, 1.0), else_=0.0)).label("held"),
            func.avg(func.coalesce(s.gpu_util, 0.0)).label("active"),
        )
        .where(s.ts >= window.start, s.ts < window.end)
        .group_by(bucket, s.device_id)
        .subquery()
    )
    stmt = (
        select(per_device.c.t, func.sum(per_device.c.held).label("held"),
               func.sum(per_device.c.active).label("active"))
        .group_by(per_device.c.t)
        .order_by(per_device.c.t)
    )
    return _frame(store, stmt)


def device_utilisation(store: Store, window: Window) -> pd.DataFrame:
    """Mean utilisation per device in the window (device_id, host_id, name, util_mean) for the distribution."""
    if window.uses_rollups:
        weighted = func.sum(Rollup.util_mean * Rollup.samples) / func.nullif(
            func.sum(case((Rollup.util_mean.is_not(None), Rollup.samples), else_=0)), 0
        )
        sub = (
            select(Rollup.subject.label("subject"), weighted.label("util_mean"))
            .where(Rollup.scope == "device", Rollup.hour >= window.start, Rollup.hour < window.end)
            .group_by(Rollup.subject)
            .subquery()
        )
        stmt = select(
            Device.id.label("device_id"), Device.host_id, Device.name, sub.c.util_mean
        ).join(sub, cast(Device.id, sub.c.subject.type) == sub.c.subject)
        return _frame(store, stmt)
    s = DeviceSample
    sub = (
        select(s.device_id, func.avg(s.gpu_util).label("util_mean"))
        .where(s.ts >= window.start, s.ts < window.end)
        .group_by(s.device_id)
        .subquery()
    )
    stmt = select(Device.id.label("device_id"), Device.host_id, Device.name, sub.c.util_mean).join(
        sub, sub.c.device_id == Device.id
    )
    return _frame(store, stmt)


def hosts(store: Store, now: float | None = None, silence_s: float | None = None) -> pd.DataFrame:
    """Hosts with their agent, device count, when each was last heard from, and whether the enforcer leaves it
    alone: `status` "not heard from" or "takes no new job" and `why`, by the store's one rule
    (store.registry.hosts_left_alone over `silence_s`, else Settings.host_silence_s), "ok" otherwise. Hosts left
    alone come first, then the others by when they were last heard from, latest first."""
    now = time.time() if now is None else now
    silence_s = get_settings().host_silence_s if silence_s is None else silence_s
    n_devices = (
        select(Device.host_id, func.count().label("devices"))
        .where(Device.state == "ok")
        .group_by(Device.host_id)
        .subquery()
    )
    stmt = (
        select(
            Host.id.label("host"),
            Host.hostname,
            Host.source,
            Host.agent_version,
            func.coalesce(n_devices.c.devices, 0).label("devices"),
        )
        .outerjoin(n_devices, n_devices.c.host_id == Host.id)
    )
    with store.session() as session:
        df = pd.read_sql(stmt, session.connection())
        ids = list(df.host)
        heard = hosts_heard_from(session, ids)  # a heartbeat, or an importer's record of the node's devices
        silent, closed = hosts_left_alone(session, ids, silence_s, now)
    df["last_seen"] = [heard.get(h, float("nan")) for h in df.host]
    df["silent_s"] = now - df.last_seen
    df["status"] = [HOST_NOT_HEARD_FROM if h in silent else HOST_CLOSED if h in closed else "ok" for h in df.host]
    df["why"] = [silent.get(h) or closed.get(h) or "" for h in df.host]
    order = df.status.map({HOST_NOT_HEARD_FROM: 0, HOST_CLOSED: 1}).fillna(2)
    return (df.assign(_order=order).sort_values(["_order", "last_seen", "host"], ascending=[True, False, True])
            .drop(columns="_order").reset_index(drop=True))


def plans(store: Store, window: Window | None = None, limit: int = 200) -> pd.DataFrame:
    stmt = select(
        Plan.id, Plan.created_at, Plan.policy, Plan.applied, Plan.devices_freed, Plan.moves, Plan.summary
    ).order_by(Plan.created_at.desc()).limit(limit)
    if window is not None:
        stmt = stmt.where(Plan.created_at >= window.start, Plan.created_at < window.end)
    return _frame(store, stmt)


def consolidation_cycles(store: Store, limit: int = 500) -> pd.DataFrame:
    """Each consolidation cycle (plans of policy "consolidate"), oldest first: t, plan_id, applied, devices held,
    devices the plan needs, devices freed, and its moves (workflow, from, to, reason) as recorded."""
    stmt = (select(Plan.id, Plan.created_at, Plan.applied, Plan.devices_freed, Plan.moves, Plan.summary)
            .where(Plan.policy == "consolidate").order_by(Plan.created_at.desc()).limit(limit))
    df = _frame(store, stmt)
    rows = []
    for r in df.itertuples():
        summary = r.summary or {}
        rows.append({"t": r.created_at, "plan_id": r.id, "applied": bool(r.applied),
                     "devices_held": summary.get("devices_held"), "devices_needed": summary.get("devices_needed"),
                     "devices_freed": r.devices_freed,
                     "moves": [{"workflow_id": m.get("workflow_id"), "from_device_id": m.get("from_device_id"),
                                "to_device_id": m.get("to_device_id"), "reason": ", ".join(m.get("rules") or [])}
                               for m in (r.moves or [])]})
    return pd.DataFrame(rows, columns=["t", "plan_id", "applied", "devices_held", "devices_needed", "devices_freed",
                                       "moves"]).iloc[::-1].reset_index(drop=True)


def freed_over_time(store: Store, window: Window) -> pd.DataFrame:
    """Devices freed by applied plans per bucket (t, devices_freed, plans)."""
    bucket = _bucket(store, Plan.created_at, 3600 if window.seconds <= 2 * 86400 else 86400).label("t")
    stmt = (
        select(bucket, func.sum(Plan.devices_freed).label("devices_freed"), func.count().label("plans"))
        .where(Plan.applied.is_(True), Plan.created_at >= window.start, Plan.created_at < window.end)
        .group_by(bucket)
        .order_by(bucket)
    )
    return _frame(store, stmt)


def actions(store: Store, limit: int = 500) -> pd.DataFrame:
    stmt = (
        select(
            Action.id, Action.plan_id, Action.kind, Action.engine, Action.workflow_id, Action.policy,
            Action.from_device_id,
            Action.to_device_id, Action.to_lane_id, Action.state, Action.expected_slowdown, Action.attempts,
            Action.error, Action.created_at, Action.updated_at,
        )
        .order_by(Action.created_at.desc())
        .limit(limit)
    )
    return _frame(store, stmt)


def host_events(store: Store, limit: int = 200) -> pd.DataFrame:
    """The hosts' latest events (the MPS daemon started, died, is missing...), newest first."""
    stmt = (
        select(HostEvent.ts, HostEvent.host_id.label("host"), HostEvent.kind, HostEvent.level, HostEvent.message)
        .order_by(HostEvent.ts.desc(), HostEvent.id.desc())
        .limit(limit)
    )
    return _frame(store, stmt)


def action_events(store: Store, action_id: int) -> pd.DataFrame:
    stmt = (
        select(ActionEvent.ts, ActionEvent.from_state, ActionEvent.to_state, ActionEvent.message, ActionEvent.detail)
        .where(ActionEvent.action_id == action_id)
        .order_by(ActionEvent.ts, ActionEvent.id)
    )
    return _frame(store, stmt)


# ---------------------------------------------------------------- findings


def _findings_stmt(
    *,
    workflow_id: str | None = None,
    rules: tuple[str, ...] = (),
    severities: tuple[str, ...] = (),
    teams: tuple[str, ...] = (),
    statuses: tuple[str, ...] = (),
) -> Select:
    f = Finding
    stmt = (
        select(
            f.id, f.workflow_id, Workflow.team, f.rule, f.source, f.severity, f.title, f.status,
            f.gpu_hours_per_day, f.cost_s_per_step, f.location, f.evidence, f.fix, f.trace_id, f.device_id,
            f.updated_at, f.acted_by, f.fingerprint,
        )
        .outerjoin(Workflow, Workflow.id == f.workflow_id)
        .order_by(f.gpu_hours_per_day.desc(), f.id)
    )
    conditions = []
    if workflow_id is not None:
        conditions.append(f.workflow_id == workflow_id)
    if rules:
        conditions.append(f.rule.in_(rules))
    if severities:
        conditions.append(f.severity.in_(severities))
    if teams:
        conditions.append(Workflow.team.in_(teams))
    if statuses:
        conditions.append(f.status.in_(statuses))
    if conditions:
        stmt = stmt.where(and_(*conditions))
    return stmt


def findings(store: Store, **filters: Any) -> pd.DataFrame:
    """Findings matching the filters, each costed by the one waste function (gpu_hours_per_day, basis)."""
    return findings_with_waste(store, **filters)[0]


def findings_with_waste(store: Store, **filters: Any) -> tuple[pd.DataFrame, Waste]:
    """findings(), and analyzer.waste's result over them (the total the page shows), on the last day's held time of
    the workflows they are filtered to (their teams, or the one workflow), as `fleetlens findings` counts it."""
    df = _frame(store, _findings_stmt(**filters))
    w = waste(df, held_from_rollups(store, team=filters.get("teams") or None, workflow=filters.get("workflow_id")))
    return costed(df, w), w


def finding_facets(store: Store) -> dict[str, list[str]]:
    """The rules, severities and teams present, for the filters."""
    with store.session() as session:
        rules = sorted(r for r in session.scalars(select(Finding.rule).distinct()) if r)
        severities = sorted(r for r in session.scalars(select(Finding.severity).distinct()) if r)
        teams = sorted(
            t for t in session.scalars(
                select(Workflow.team).join(Finding, Finding.workflow_id == Workflow.id).distinct()
            ) if t
        )
    return {"rules": rules, "severities": severities, "teams": teams}


# ---------------------------------------------------------------- enforcement


def lanes(store: Store) -> pd.DataFrame:
    """Open lanes with their device and the workflows placed in them (one row per lane x job; job may be None)."""
    stmt = (
        select(
            Lane.id.label("lane_id"), Lane.device_id, Device.host_id, Device.name.label("device_name"),
            Device.memory_total, Lane.size_bytes, Lane.compute_share, Placement.workflow_id,
            Placement.mem_persistent, Placement.mem_ephemeral,
        )
        .join(Device, Device.id == Lane.device_id)
        .outerjoin(Placement, and_(Placement.lane_id == Lane.id, Placement.state == "active"))
        .where(Lane.state == "open")
        .order_by(Lane.device_id, Lane.id)
    )
    return _frame(store, stmt)


def sweeps(store: Store) -> pd.DataFrame:
    """Every recorded sweep, newest first: id, engine, GPUs, settings, created_at."""
    return pd.DataFrame(sweep_rows(store), columns=["id", "engine", "gpus", "settings", "created_at"])


def sweep_events(store: Store, sweep_id: str, gpus: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """A sweep's events in order, and its GPU use after each (held by the sweep, and one trial per GPU)."""
    rows = sweep_event_rows(store, sweep_id)
    frame = pd.DataFrame([r.__dict__ for r in rows],
                         columns=["seq", "ts", "trial_id", "kind", "old_width", "new_width", "steps_left", "reason"])
    use = pd.DataFrame(gpu_use(rows, gpus), columns=["t", "held", "one_per_gpu"])
    return frame, use


def sweep_trials(store: Store) -> pd.DataFrame:
    """Trials grouped into sweeps by FLEETLENS_SWEEP (tuners other than Ray Tune): sweep, trial, workflow, state."""
    return pd.DataFrame(labelled_trials(store), columns=["sweep", "trial", "workflow", "state", "last_seen"])


def serving_raw_counts(store: Store) -> dict[str, tuple[int, int]]:
    """Per workflow that keeps raw requests (opt-in): (rows stored, requests counted over the cap)."""
    with store.session() as s:
        return all_raw_counts(s)


def serving_windows(store: Store, window: Window) -> list[AppWindow]:
    """Each serving application's minutes over the window (store.serving): counts, histograms, SLO."""
    with store.session() as s:
        return app_windows(s, window.start, window.end)
