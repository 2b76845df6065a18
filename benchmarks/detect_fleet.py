"""Telemetry detection at fleet scale, on SQLite; one JSON line per case.

- detect_24h: `detect()` over a day of 1,000 devices (125 hosts x 8, one workflow each, a quarter idle) sampled
  once a minute (2.88 M device and process rows), against the anchor: fetching the same rows with a plain cursor
  and nothing else, what any detector must at least pay.
- rollup: the hourly rollup of one hour (what the hourly DAG does) and a 24-hour backfill of the same store.
- agent_rate: 250 devices sampled every 10 s for a day (4.3 M rows): `detect()` reading minute buckets that the
  database averages (thresholds' bucket_s = 60), against the same detect reading every sample (bucket_s = 0).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.synthetic_fleet import DAY, GIB, host_id, register_fleet, workflow_id  # noqa: E402
from store.db import Store  # noqa: E402
from store.ingest import write_samples  # noqa: E402
from store.migrations import upgrade  # noqa: E402
from store.samples import DEVICE_SAMPLE_COLUMNS, PROCESS_SAMPLE_COLUMNS  # noqa: E402

N_DEVICES, HOUR = 1000, 3600.0


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def seed(store: Store, now: float, n_devices: int = N_DEVICES, interval_s: float = 60.0) -> int:
    rng = np.random.default_rng(1)
    register_fleet(store, n_devices, now)
    util = rng.beta(2, 3, size=n_devices)
    util[: n_devices // 4] = 0.0  # idle holders
    ts = (now - DAY + interval_s * np.arange(int(DAY // interval_s))).tolist()

    def device_rows():
        for d in range(n_devices):
            u = float(util[d])
            row = {"device_id": d + 1, "gpu_util": u, "mem_util": u / 2, "mem_used": 40 * GIB, "mem_total": 80 * GIB,
                   "power_w": 300.0, "temperature_c": 60.0, "sm_clock_mhz": 1800.0, "sm_active": u * 0.8}
            for t in ts:
                row["ts"] = t
                yield tuple(row.get(c) for c in DEVICE_SAMPLE_COLUMNS)

    def process_rows():
        for d in range(n_devices):
            row = {"device_id": d + 1, "workflow_id": workflow_id(d), "host_id": host_id(d),
                   "pid": 1000 + d, "mem_used": 40 * GIB, "sm_util": float(util[d])}
            for t in ts:
                row["ts"] = t
                yield tuple(row.get(c) for c in PROCESS_SAMPLE_COLUMNS)

    written = write_samples(store, device_rows(), process_rows())
    return sum(written)


def bare_fetch(store: Store, start: float, end: float) -> float:
    """The anchor: the window's sample rows, fetched and dropped, the fastest way SQLite has for a window that
    is the whole table (a sequential scan: `+ts` keeps the planner off the ts index, as load_window does)."""
    t0 = time.perf_counter()
    with store.engine.connect() as conn:
        cursor = conn.connection.driver_connection.cursor()
        for table, cols in (("device_samples", "device_id, ts, gpu_util, mem_used, mem_total, sm_active"),
                            ("process_samples", "workflow_id, device_id, ts, mem_used, sm_util, cpu_util")):
            cursor.execute(f"SELECT {cols} FROM {table} WHERE +ts >= ? AND +ts < ?", (start, end))
            cursor.fetchall()
        cursor.close()
    return time.perf_counter() - t0


@contextmanager
def seeded_store(n_devices: int = N_DEVICES, interval_s: float = 60.0) -> Iterator[tuple[Store, float, int]]:
    """(store, now, sample rows): a fresh SQLite store under a temporary FLEETLENS_HOME, seeded, its cache warm."""
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["FLEETLENS_HOME"] = tmp
        store = Store(f"sqlite:///{Path(tmp) / 'fleetlens.db'}")
        upgrade(store)
        now = (time.time() // HOUR) * HOUR
        t0 = time.perf_counter()
        rows = seed(store, now, n_devices, interval_s)
        log(f"seeded {rows:,} sample rows ({interval_s:.0f} s apart) in {time.perf_counter() - t0:.1f} s")
        bare_fetch(store, now - DAY, now)  # SQLite's page cache warm for whatever runs first
        try:
            yield store, now, rows
        finally:
            store.dispose()


def main() -> None:
    from analyzer.rollups import rollup
    from analyzer.telemetry import detect

    with seeded_store() as (store, now, rows):
        ours, anchor, found = [], [], 0
        for _ in range(2):
            t0 = time.perf_counter()
            found = len(detect(store, now=now, window_s=DAY))
            ours.append(time.perf_counter() - t0)
            anchor.append(bare_fetch(store, now - DAY, now))
        o, a = statistics.median(ours), statistics.median(anchor)
        print(json.dumps({
            "benchmark": "detect_fleet", "case": "detect_24h", "devices": N_DEVICES, "sample_rows": rows,
            "findings": found, "detect_s": round(o, 2), "bare_fetch_s": round(a, 2), "ratio": round(o / a, 2),
        }), flush=True)
        # the day was written after its hours closed, so every hour of it is marked late (store.late_hours) and
        # the first rollup rolls them all, whatever its `since`: the backfill goes first and clears the marks, and
        # the hourly rollup is then timed as the hourly job meets it, with each earlier hour rolled when it closed
        t0 = time.perf_counter()
        backfill = rollup(store, now=now, since=now - DAY)
        day = time.perf_counter() - t0
        t0 = time.perf_counter()
        hourly = rollup(store, now=now, since=now - HOUR)
        one_hour = time.perf_counter() - t0
        print(json.dumps({
            "benchmark": "detect_fleet", "case": "rollup", "devices": N_DEVICES, "hourly_rows": hourly.device_rows
            + hourly.workflow_rows, "hourly_s": round(one_hour, 2), "backfill_24h_rows": backfill.device_rows
            + backfill.workflow_rows, "backfill_24h_s": round(day, 2),
            "bare_fetch_24h_s": round(a, 2), "ratio_backfill": round(day / a, 2),
        }), flush=True)
    agent_rate()


def agent_rate(n_devices: int = 250, interval_s: float = 10.0) -> None:
    from analyzer.telemetry import detect, load_thresholds

    th = load_thresholds()
    raw = replace(th, common=replace(th.common, bucket_s=0.0))
    with seeded_store(n_devices, interval_s) as (store, now, rows):
        t0 = time.perf_counter()
        bucketed = {(f.rule, f.workflow_id) for f in detect(store, now=now, window_s=DAY, thresholds=th)}
        ours = time.perf_counter() - t0
        t0 = time.perf_counter()
        every = {(f.rule, f.workflow_id) for f in detect(store, now=now, window_s=DAY, thresholds=raw)}
        anchor = time.perf_counter() - t0
        print(json.dumps({
            "benchmark": "detect_fleet", "case": "agent_rate", "devices": n_devices, "interval_s": interval_s,
            "sample_rows": rows, "bucket_s": th.common.bucket_s, "detect_bucketed_s": round(ours, 2),
            "detect_every_sample_s": round(anchor, 2), "ratio": round(ours / anchor, 3),
            "same_findings": bucketed == every, "findings": len(bucketed),
        }), flush=True)


if __name__ == "__main__":
    main()
