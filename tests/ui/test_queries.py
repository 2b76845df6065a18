"""The dashboard's queries on their own: short windows combine the analyzer's rollups with raw samples."""

from __future__ import annotations

import math

import pytest
from sqlalchemy import func, select

from analyzer.rollups import apply_retention, device_rollups, rollup
from analyzer.telemetry.frame import load_window
from analyzer.telemetry.thresholds import load_thresholds
from store.models import Rollup
from tests.analyzer.telemetry_fleet import GIB, T0, Fleet
from ui.dashboard import queries, workflow_queries
from ui.dashboard.queries import HOUR, Window


def test_six_hours_use_rolled_hours_and_raw_for_the_rest(seeded):
    store, data = seeded
    window = Window.last(6 * 3600, now=data.now)
    first_full = math.ceil(window.start / HOUR) * HOUR
    open_hour = math.floor(data.now / HOUR) * HOUR  # the seed rolled up every closed hour
    with store.session() as s:
        rolled = s.execute(select(func.sum(Rollup.gpu_hours_held), func.sum(Rollup.gpu_hours_active)).where(
            Rollup.scope == "device", Rollup.hour >= first_full, Rollup.hour < open_hour)).one()
    th = load_thresholds()
    raw = device_rollups(load_window(store, open_hour, window.end, th.common), 0.0)
    head = device_rollups(load_window(store, window.start, first_full, th.common), 0.0)
    expected_held = rolled[0] + sum(r["gpu_hours_held"] for r in raw + head)
    got = queries.fleet_hours(store, window)
    assert math.isclose(got["held"], expected_held, rel_tol=1e-9)
    assert math.isclose(got["active"], rolled[1] + sum(r["gpu_hours_active"] for r in raw + head), rel_tol=1e-9)
    assert got["devices"] == 8  # every device reported, two of them idle


def test_a_week_reads_only_rollups(seeded):
    store, data = seeded
    window = Window.last(7 * 86400, now=data.now)
    with store.session() as s:
        held = s.scalar(select(func.sum(Rollup.gpu_hours_held)).where(
            Rollup.scope == "device", Rollup.hour >= window.start, Rollup.hour < window.end))
    assert queries.fleet_hours(store, window)["held"] == held
    timeline = queries.fleet_timeline(store, window)
    assert len(timeline) == 7 * 24 - 1 and timeline.held.max() == 6.0  # one point per hour; 6 devices held


def test_a_day_window_shows_a_job_started_this_hour_at_sample_resolution(sqlite_store):
    fleet = Fleet(sqlite_store)
    d = fleet.device()
    fleet.workflow("fresh")
    fleet.run(d, "fresh", 0, 20, util=0.6, mem_gib=12)  # 20 minutes into the hour, nothing rolled up yet
    fleet.flush()
    now = T0 + 20 * 60
    rollup(sqlite_store, now=now)  # no closed hour: no rollup row
    series = workflow_queries.workflow_series(sqlite_store, "fresh", Window.last(86400, now=now))
    # minutes of data on a day's axis: a line over the 20 minutes it ran, not one dot for the hour
    assert len(series) >= 10 and set(series["source"]) == {"raw"}
    assert series["t"].min() >= T0 and series["t"].max() < T0 + 20 * 60
    assert all(math.isclose(u, 0.6) for u in series["util"].dropna())
    assert series["mem_used"].max() == 12 * GIB


def test_a_day_window_adds_the_unfinished_hour_to_the_rolled_up_ones(sqlite_store):
    fleet = Fleet(sqlite_store)
    d = fleet.device()
    fleet.workflow("steady")
    fleet.run(d, "steady", 0, 120, util=0.3, mem_gib=10)
    fleet.run(d, "steady", 120, 150, util=0.9, mem_gib=20)  # the current hour, still open
    fleet.flush()
    now = T0 + 150 * 60
    rollup(sqlite_store, now=now)
    series = workflow_queries.workflow_series(sqlite_store, "steady", Window.last(86400, now=now))
    assert list(series["source"]) == ["rollup", "rollup", "raw"]
    assert list(series["t"]) == [T0, T0 + HOUR, T0 + 2 * HOUR]
    assert series["util"].tolist() == pytest.approx([0.3, 0.3, 0.9]) and series["mem_used"].iloc[-1] == 20 * GIB


def test_a_week_window_shows_a_short_job_whose_raw_samples_retention_dropped(sqlite_store):
    fleet = Fleet(sqlite_store)
    d = fleet.device()
    fleet.workflow("brief")
    fleet.run(d, "brief", 0, 60, util=0.4, mem_gib=8)  # one hour, rolled up; its raw samples then go
    fleet.flush()
    now = T0 + 30 * HOUR
    rollup(sqlite_store, now=now)
    assert apply_retention(sqlite_store, 1.0, now=now).process_samples_deleted > 0
    series = workflow_queries.workflow_series(sqlite_store, "brief", Window.last(7 * 86400, now=now))
    assert list(series["source"]) == ["rollup"] and list(series["t"]) == [T0]
    assert series["util"].tolist() == pytest.approx([0.4]) and series["mem_used"].iloc[0] == 8 * GIB
