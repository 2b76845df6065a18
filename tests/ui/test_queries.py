"""The dashboard's queries on their own: short windows combine the analyzer's rollups with raw samples."""

from __future__ import annotations

import math

from sqlalchemy import func, select

from analyzer.rollups import device_rollups
from analyzer.telemetry.frame import load_window
from analyzer.telemetry.thresholds import load_thresholds
from store.models import Rollup
from ui.dashboard import queries
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
