"""Benchmark: the dashboard's Fleet page (AppTest run, cold cache) against the same queries run bare.

Store: SQLite with 1,000 devices (125 hosts x 8) x 7 days of hourly rollups (device and workflow scope), one day
of raw device samples at one a minute (1.44 M rows, written with store.ingest.write_samples) and a few hundred
findings. Two cases: the default 24 h window (reads rollups) and a 6 h window (raw samples, through the
analyzer's rollup function). Prints one JSON line per case: page seconds, bare seconds, ratio (target <= 1.5).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
from sqlalchemy import insert  # noqa: E402

from store.db import Store  # noqa: E402
from store.ingest import write_samples  # noqa: E402
from store.migrations import check_schema, upgrade  # noqa: E402
from store.models import Device, DeviceSample, Finding, Host, Plan, Workflow  # noqa: E402

N_HOSTS, PER_HOST, DAYS, HOUR, GIB = 125, 8, 7, 3600.0, 1024**3
# (case, window, seconds, repeats): 6 h = rolled-up hours plus the analyzer run over the raw rest
CASES = (("fleet_24h_rollups", "24 hours", 86400, 3), ("fleet_6h_raw", "6 hours", 21600, 2))


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def seed(store: Store, now: float) -> dict[str, int]:
    rng = np.random.default_rng(7)
    n_dev = N_HOSTS * PER_HOST
    last_hour = np.floor(now / HOUR) * HOUR - HOUR
    with store.engine.begin() as conn:
        conn.execute(insert(Host), [
            {"id": f"h{h:03d}", "hostname": f"h{h:03d}", "source": "nvml", "agent_version": "0.1.0",
             "started_at": now - 8 * 86400, "last_seen": now - rng.uniform(0, 300), "labels": {}}
            for h in range(N_HOSTS)])
        conn.execute(insert(Device), [
            {"id": d + 1, "host_id": f"h{d // PER_HOST:03d}", "index": d % PER_HOST, "uuid": f"GPU-{d}",
             "name": "NVIDIA H100 80GB HBM3", "source": "nvml", "memory_total": 80 * GIB, "state": "ok",
             "registered_at": now - 8 * 86400, "last_seen": now} for d in range(n_dev)])
        conn.execute(insert(Workflow), [
            {"id": f"wf-{d:04d}", "team": f"team-{d % 12}", "labels": {}, "created_at": now - 8 * 86400,
             "last_seen": now, "state": "running", "gpus": 1} for d in range(n_dev)])
        util = rng.beta(2, 3, size=n_dev)
        held = rng.uniform(size=n_dev) < 0.85
        cols = ("scope", "subject", "hour", "team", "samples", "gpu_hours_held", "gpu_hours_active", "util_mean",
                "util_p95", "sm_active_mean", "mem_peak", "mem_total", "computed_at")
        sql = f"INSERT INTO rollups ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})"
        teams = [f"team-{d % 12}" for d in range(n_dev)]
        u_all = np.where(held, util, 0.0).tolist()
        held_f = held.astype(float).tolist()

        def rollup_rows():
            for h in range(DAYS * 24):
                hour = float(last_hour - h * HOUR)
                for d in range(n_dev):
                    u = u_all[d]
                    tail = (hour, teams[d], 60, held_f[d], u, u, min(1.0, u + 0.1), u * 0.8, 40 * GIB, 80 * GIB, now)
                    yield ("device", str(d + 1), *tail)
                    yield ("workflow", f"wf-{d:04d}", *tail)

        conn.connection.driver_connection.executemany(sql, rollup_rows())
        conn.execute(insert(Finding), [
            {"fingerprint": f"low_utilization|wf-{d:04d}|", "workflow_id": f"wf-{d:04d}", "device_id": d + 1,
             "rule": "low_utilization", "source": "telemetry", "severity": ("low", "medium", "high")[d % 3],
             "title": "low utilisation", "evidence": {}, "fix": "pack it",
             "gpu_hours_per_day": float(24 * (1 - util[d])),
             "status": "open", "created_at": now, "updated_at": now} for d in range(0, n_dev, 3)])
        conn.execute(insert(Plan), [
            {"created_at": now - k * 6 * HOUR, "policy": "pack", "applied": True, "devices_freed": k % 4,
             "moves": [], "summary": {}} for k in range(28)])

    def samples():
        ts = (now - 86400 + 60.0 * np.arange(1440)).tolist()
        for d in range(n_dev):
            u = (np.clip(util[d] + rng.normal(0, 0.05, size=len(ts)), 0, 1) if held[d] else np.zeros(len(ts))).tolist()
            mem = 40 * GIB if held[d] else 0
            did = d + 1
            for t, x in zip(ts, u, strict=True):
                yield (did, t, x, x / 2, mem, 80 * GIB, 300.0, 60.0, 1800.0, 0, 0, 0, x * 0.8, None, None)

    # Loading 1.44 M rows into indexed tables is several times slower than indexing them once afterwards.
    indexes = [(i.name, i) for i in DeviceSample.__table__.indexes]
    with store.engine.begin() as conn:
        for name, _ in indexes:
            conn.exec_driver_sql(f"DROP INDEX {name}")
    write_samples(store, samples())
    with store.engine.begin() as conn:
        for _, index in indexes:
            index.create(conn)
    return {"devices": n_dev, "rollups": DAYS * 24 * n_dev * 2, "samples": 1440 * n_dev}


def bare(store: Store, window_s: float) -> float:
    """The Fleet page's queries and analyzer calls, without Streamlit."""
    from analyzer.ranking import rank_workflows, teams_of
    from ui.dashboard import queries
    from ui.dashboard.queries import Window

    t0 = time.perf_counter()
    window = Window.last(window_s)
    check_schema(store)
    queries.store_state(store)
    queries.fleet_hours(store, window)
    queries.fleet_timeline(store, window)
    queries.device_utilisation(store, window)
    queries.freed_over_time(store, window)
    queries.hosts(store)
    queries.plans(store, window, limit=20)
    queries.actions(store, limit=1000)
    teams_of(rank_workflows(store, now=window.end, period_s=window.seconds))
    return time.perf_counter() - t0


def page(at, window_label: str) -> float:
    """One run of the Fleet page with a cold cache, on an AppTest whose harness is already set up.

    AppTest's first run scans every installed package for Streamlit components (seconds, once per server in
    real life), so the page is timed on later runs of the same AppTest.
    """
    import streamlit as st

    st.cache_data.clear()  # a cold page: every query runs
    at.session_state["fl_window"] = window_label
    t0 = time.perf_counter()
    at.run()
    elapsed = time.perf_counter() - t0
    if at.exception:
        raise RuntimeError(at.exception[0].value)
    assert at.metric[1].value == "1,000", [m.value for m in at.metric]
    return elapsed


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{Path(tmp) / 'fleetlens.db'}"
        os.environ["FLEETLENS_DB_URL"] = url
        os.environ["FLEETLENS_HOME"] = tmp
        store = Store(url)
        upgrade(store)
        now = time.time()
        t0 = time.perf_counter()
        sizes = seed(store, now)
        seed_s = time.perf_counter() - t0
        log(f"seeded {sizes} in {seed_s:.1f} s")
        from streamlit.testing.v1 import AppTest

        at = AppTest.from_file(str(ROOT / "ui" / "dashboard" / "views" / "fleet.py"), default_timeout=300)
        for case, label, seconds, repeats in CASES:
            page(at, label)  # harness set-up, imports and SQLite's page cache; the bare run below gets them too
            bare(store, seconds)
            pages, bares = [], []
            for _ in range(repeats):
                pages.append(page(at, label))
                bares.append(bare(store, seconds))
            p, b = statistics.median(pages), statistics.median(bares)
            print(json.dumps({
                "benchmark": "ui_overview", "case": case, "devices": sizes["devices"], "rollup_rows": sizes["rollups"],
                "raw_samples": sizes["samples"], "page_s": round(p, 3), "bare_queries_s": round(b, 3),
                "ratio": round(p / b, 3), "target_ratio": 1.5, "seed_s": round(seed_s, 1),
            }), flush=True)
        store.dispose()


if __name__ == "__main__":
    main()
