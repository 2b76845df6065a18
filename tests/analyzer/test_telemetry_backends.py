"""PostgreSQL (the fleet's store, read through the database's own CSV text) and SQLite (one host, read through its
cursor) give the same findings and the same rollups on the same samples: two hours at one sample a minute, then an
hour at 5 s (read as minute buckets while the older minutes are read as recorded), every detector firing once,
a shared device, and process samples off the device's sampling times (attributed to the nearest device sample)."""

from __future__ import annotations

import pandas as pd
import pytest
from sqlalchemy import select

from analyzer.rollups import rollup
from analyzer.telemetry import detect, load_thresholds, load_window
from store.models import Rollup
from tests.analyzer.telemetry_fleet import GIB, T0, Fleet

MINUTES, FAST_STEPS = 120, 720  # two hours of minute samples, then an hour of 5 s samples
FAST_T0 = T0 + MINUTES * 60
NOW = FAST_T0 + FAST_STEPS * 5.0
WINDOW = NOW - T0
RULES = {"idle_holder", "low_utilization", "misleading_utilization", "memory_overprovisioned", "zombie_memory"}


def _both(fleet: Fleet, dev: int, wf: str | None, *, util: float, mem_gib: float, **kw) -> None:
    """The same behaviour over the minute part and the 5 s part of the window."""
    fleet.t0, fleet.interval = T0, 60.0
    fleet.run(dev, wf, 0, MINUTES, util=util, mem_gib=mem_gib, **kw)
    fleet.t0, fleet.interval = FAST_T0, 5.0
    fleet.run(dev, wf, 0, FAST_STEPS, util=util, mem_gib=mem_gib, **kw)


def seed(store) -> dict[str, int]:
    fleet = Fleet(store)
    devs = {name: fleet.device() for name in ("idle", "low", "misleading", "shared", "zombie", "healthy", "offset")}
    for wf in ("idle", "low", "misleading", "a", "b", "zombie", "healthy", "offset"):
        fleet.workflow(wf, team="t")
    fleet.process("zombie", "h1", 300, 0, ended_min=30)
    # busy for the first hour, then idle holding 40 GiB
    fleet.run(devs["idle"], "idle", 0, 60, util=0.9, mem_gib=40, sm_active=0.8)
    fleet.run(devs["idle"], "idle", 60, MINUTES, util=0.0, mem_gib=40, sm_active=0.0)
    fleet.t0, fleet.interval = FAST_T0, 5.0
    fleet.run(devs["idle"], "idle", 0, FAST_STEPS, util=0.0, mem_gib=40, sm_active=0.0)
    _both(fleet, devs["low"], "low", util=0.1, mem_gib=10, sm_active=0.1)  # low p95, 10 of 80 GiB
    _both(fleet, devs["misleading"], "misleading", util=0.9, mem_gib=60, sm_active=0.1)
    _both(fleet, devs["shared"], "a", util=0.5, mem_gib=40, wf_mem_gib=30, pid=1, sm_active=0.45)
    _both(fleet, devs["shared"], "b", util=0.5, mem_gib=40, wf_mem_gib=10, pid=2, device_rows=False)
    _both(fleet, devs["healthy"], "healthy", util=0.92, mem_gib=70, sm_active=0.85)
    # one extra sample half a minute into minute 10: read as recorded it is a row of its own, in a bucket it is not
    fleet.t0, fleet.interval = T0 + 30.0, 60.0
    fleet.run(devs["healthy"], "healthy", 10, 11, util=0.92, mem_gib=70, sm_active=0.85)
    # the zombie's process ends after 30 minutes; its 30 GiB stay on the device with nobody on it
    fleet.t0, fleet.interval = T0, 60.0
    fleet.run(devs["zombie"], "zombie", 0, 30, util=0.7, mem_gib=30, sm_active=0.6, pid=300)
    fleet.run(devs["zombie"], None, 30, MINUTES, util=0.0, mem_gib=30)
    fleet.t0, fleet.interval = FAST_T0, 5.0
    fleet.run(devs["zombie"], None, 0, FAST_STEPS, util=0.0, mem_gib=30)
    # an agent whose process samples come 2 s after the device's: attributed to the nearest device sample
    _both(fleet, devs["offset"], "offset", util=0.05, mem_gib=20, sm_active=0.05, pid=400)
    for row in fleet.process_rows:
        if row["workflow_id"] == "offset":
            row["ts"] += 2.0
    fleet.flush()
    return devs


def _findings(store) -> list[tuple]:
    found = detect(store, now=NOW, window_s=WINDOW)
    return sorted((f.fingerprint, f.severity, f.title, f.location, f.fix, f.gpu_hours_per_day, f.device_id,
                   sorted(f.evidence.items())) for f in found)


def _rollups(store) -> pd.DataFrame:
    rollup(store, now=NOW)
    with store.engine.connect() as conn:
        frame = pd.read_sql_query(select(Rollup).order_by(Rollup.scope, Rollup.subject, Rollup.hour), conn)
    return frame.drop(columns=["id", "computed_at"]).reset_index(drop=True)


@pytest.mark.pg
def test_postgres_and_sqlite_find_the_same_and_roll_up_the_same(sqlite_store, pg_store):
    assert seed(sqlite_store) == seed(pg_store)
    on_sqlite, on_pg = _findings(sqlite_store), _findings(pg_store)
    assert {f[0].split("|")[0] for f in on_sqlite} == RULES  # every detector fires: the comparison is not empty
    assert {f[0] for f in on_sqlite if f[0].startswith("idle_holder")} >= {"idle_holder|idle|device:1",
                                                                          "idle_holder|offset|device:7"}
    assert on_pg == on_sqlite
    r_sqlite, r_pg = _rollups(sqlite_store), _rollups(pg_store)
    # three hours of each device and of each workflow but the zombie, whose process ran in the first hour only
    assert len(r_sqlite) == 3 * 7 + 3 * 7 + 1
    pd.testing.assert_frame_equal(r_pg, r_sqlite, check_dtype=False, rtol=1e-9)


def test_a_window_of_minutes_then_seconds_reads_only_the_fast_hour_in_buckets(any_store):
    seed_devices = seed(any_store)
    window = load_window(any_store, T0, NOW, load_thresholds().common)
    s = window.samples
    per_device = s.groupby("device_id").size()
    healthy = seed_devices["healthy"]
    # every minute once, recorded or a bucket of 12 samples; the healthy device's extra sample is read as recorded
    assert set(per_device.drop(healthy)) == {MINUTES + FAST_STEPS // 12}
    assert per_device[healthy] == MINUTES + 1 + FAST_STEPS // 12
    assert set(s.loc[s["ts"] < FAST_T0, "n_raw"]) == {1.0} and set(s.loc[s["ts"] >= FAST_T0, "n_raw"]) == {12.0}
    # the offset agent's process samples all found their device samples
    offset = window.usage[window.usage["workflow_id"] == "offset"]
    assert len(offset) == MINUTES + FAST_STEPS // 12
    assert offset["wf_mem"].max() == 20 * GIB
