"""Telemetry at fleet scale on PostgreSQL: 10,000 devices (1,250 hosts x 8, one workflow each, a quarter idle).

- ingest_rows_per_s: the fleet's 1 Hz device and process samples written through `store.ingest.write_samples`
  (binary COPY into the day-partitioned tables), `--ingest-s` seconds of the fleet in batches of 10 s.
- day_rows: a day of the fleet at one row per device-minute (and one per workflow-minute), what the detectors read
  once 1 Hz samples are bucketed to minutes; generated inside PostgreSQL (`generate_series`), not timed.
- rollup_hour_s: `analyzer.rollups.rollup` of the last hour (the hourly job): the hour's device and workflow
  rollups and the telemetry detectors' summary of the hour (analyzer.telemetry.hour_summaries). The 23 hours before
  it are rolled up first, untimed, as the hourly job would have done when each closed.
- detect_day_s, detect_peak_rss_mib: `analyzer.telemetry.detect` over the day, in a process of its own (its peak
  resident memory, VmHWM, is the whole process's, imports included): it combines the 24 kept hours; against the anchor
- detect_from_samples_s, detect_from_samples_rss_mib, findings_from_samples: the same detection with no kept hour
  (a store whose hours are not rolled up yet, or thresholds other than the rollup's): every sample of the day read.
- bare_fetch_day_s: a bare aggregate query over the same rows in the same run (per device, and per workflow and
  device: count, mean utilisation, peak memory), the least any set-based detector must pay to read the day.

Targets: rollup_hour_s <= 5, detect_day_s <= 60 and <= 2x bare_fetch_day_s, detect_peak_rss_mib <= 1024.
One JSON line on stdout; progress on stderr. The schema it makes is dropped at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
from sqlalchemy import create_engine, text  # noqa: E402

from benchmarks.synthetic_fleet import (  # noqa: E402
    DAY,
    GIB,
    HOST_DIGITS,
    PER_HOST,
    WORKFLOW_DIGITS,
    host_id,
    register_fleet,
    workflow_id,
)
from store.db import Store  # noqa: E402
from store.ingest import write_samples  # noqa: E402
from store.migrations import upgrade  # noqa: E402
from store.partitions import ensure_partitions  # noqa: E402
from store.samples import DeviceSampleRow, ProcessSampleRow  # noqa: E402

HOUR = 3600.0
DETECT_MEMORY_LIMIT = 8 << 30  # the detection process is stopped past this address space rather than swap the box


def log(msg: str) -> None:
    print(f"[fleet_scale {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def register(store: Store, n: int, now: float) -> np.ndarray:
    """The synthetic fleet of n devices; returns each device's utilisation."""
    register_fleet(store, n, now)
    ids = np.arange(1, n + 1)
    # the first quarter idle holders, the rest spread over 0.2-0.8 (the same formula seed_day uses in SQL)
    return np.where(ids <= n // 4, 0.0, 0.2 + 0.6 * ((ids * 7919) % 1000) / 1000.0)


def seed_day(store: Store, n: int, start: float, end: float) -> int:
    """One row per device-minute and per workflow-minute over [start, end), generated in the database."""
    minutes = int((end - start) // 60)
    with store.engine.begin() as conn:
        # utilisation per device as in register(): the first quarter idle, the rest spread by device id
        util = f"CASE WHEN d <= {n // 4} THEN 0.0 ELSE 0.2 + 0.6 * ((d * 7919) % 1000) / 1000.0 END"
        conn.execute(text(
            f"INSERT INTO device_samples (device_id, ts, gpu_util, mem_util, mem_used, mem_total, power_w, "
            f"temperature_c, sm_clock_mhz, sm_active) SELECT d, t, u, u / 2, {40 * GIB}, {80 * GIB}, 300.0, 60.0, "
            f"1800.0, u * 0.8 FROM generate_series(1, {n}) AS d, LATERAL (SELECT {util} AS u) AS x, "
            f"LATERAL (SELECT {start!r}::float8 + 60.0 * m AS t FROM generate_series(0, {minutes - 1}) AS m) AS tt"))
        conn.execute(text(
            f"INSERT INTO process_samples (device_id, workflow_id, host_id, pid, ts, mem_used, sm_util) "
            f"SELECT d, 'wf-' || lpad((d - 1)::text, {WORKFLOW_DIGITS}, '0'), "
            f"'h' || lpad(((d - 1) / {PER_HOST})::text, {HOST_DIGITS}, '0'), "
            f"1000 + d, t, {40 * GIB}, u FROM generate_series(1, {n}) AS d, LATERAL (SELECT {util} AS u) AS x, "
            f"LATERAL (SELECT {start!r}::float8 + 60.0 * m AS t FROM generate_series(0, {minutes - 1}) AS m) AS tt"))
        conn.execute(text("ANALYZE device_samples"))
        conn.execute(text("ANALYZE process_samples"))
        rows = conn.execute(text(f"SELECT (SELECT count(*) FROM device_samples WHERE ts >= {start!r} AND ts < "
                                 f"{end!r}) + (SELECT count(*) FROM process_samples WHERE ts >= {start!r} AND ts < "
                                 f"{end!r})")).scalar()
    return int(rows)


def ingest(store: Store, util: np.ndarray, start: float, seconds: int) -> tuple[int, float]:
    """The fleet's 1 Hz rows of [start, start + seconds), written in 10-second batches; (rows, seconds taken)."""
    n = len(util)
    written, took = 0, 0.0
    for b0 in range(0, seconds, 10):
        ts = [start + s for s in range(b0, min(seconds, b0 + 10))]
        dev, proc = [], []
        for d in range(n):
            u = float(util[d])
            device = DeviceSampleRow(d + 1, 0.0, gpu_util=u, mem_util=u / 2, mem_used=40 * GIB, mem_total=80 * GIB,
                                     power_w=300.0, sm_active=u * 0.8)
            process = ProcessSampleRow(d + 1, workflow_id(d), host_id(d), 1000 + d, 0.0,
                                       mem_used=40 * GIB, sm_util=u)
            for t in ts:
                dev.append(device._replace(ts=t))
                proc.append(process._replace(ts=t))
        t0 = time.perf_counter()
        nd, np_ = write_samples(store, dev, proc)
        took += time.perf_counter() - t0
        written += nd + np_
    return written, took


def bare_fetch(store: Store, start: float, end: float) -> float:
    t0 = time.perf_counter()
    with store.engine.connect() as conn:
        conn.execute(text(
            f"SELECT device_id, count(*), avg(gpu_util), max(mem_used), avg(sm_active) FROM device_samples "
            f"WHERE ts >= {start!r} AND ts < {end!r} GROUP BY device_id")).all()
        conn.execute(text(
            f"SELECT workflow_id, device_id, count(*), avg(sm_util), max(mem_used) FROM process_samples "
            f"WHERE ts >= {start!r} AND ts < {end!r} GROUP BY workflow_id, device_id")).all()
    return time.perf_counter() - t0


def _peak_rss_mib() -> float:
    """This process's own peak resident memory (VmHWM). Not getrusage's ru_maxrss: Linux carries the maximum across
    exec, so a child started by a large parent would report the parent's size."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024.0
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def detect_child(url: str, now: float) -> None:
    """In its own process: detect over the day ending `now`; prints seconds, findings and peak RSS."""
    from analyzer.telemetry import detect

    store = Store(url)
    t0 = time.perf_counter()
    found = detect(store, now=now, window_s=DAY)
    took = time.perf_counter() - t0
    rss = _peak_rss_mib()
    print(json.dumps({"detect_s": took, "findings": len(found), "peak_rss_mib": rss,
                      "by_rule": {r: sum(f.rule == r for f in found) for r in {f.rule for f in found}}}), flush=True)


def run_detect(url: str, now: float) -> dict:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (DETECT_MEMORY_LIMIT, DETECT_MEMORY_LIMIT))

    proc = subprocess.run([sys.executable, __file__, "--detect-child", "--db-url", url, "--now", repr(now)],
                          capture_output=True, text=True, preexec_fn=limit, timeout=3600,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["?"]
        return {"detect_s": None, "findings": None, "peak_rss_mib": None, "error": tail[0][:300]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=10_000)
    ap.add_argument("--ingest-s", type=int, default=30, help="seconds of the fleet's 1 Hz samples to write")
    ap.add_argument("--db-url", default=os.environ.get("FLEETLENS_TEST_PG_URL",
                                                       "postgresql+psycopg://postgres@127.0.0.1:5432/test"))
    ap.add_argument("--detect-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--now", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.detect_child:
        detect_child(args.db_url, args.now)
        return 0
    from analyzer.rollups import rollup

    schema = f"fl_scale_{uuid.uuid4().hex[:10]}"
    admin = create_engine(Store(args.db_url).url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f"CREATE SCHEMA {schema}"))
    sep = "&" if "?" in args.db_url else "?"
    url = f"{args.db_url}{sep}options=-csearch_path%3D{schema}"
    store = Store(url)
    try:
        upgrade(store)
        now = (time.time() // HOUR) * HOUR
        ensure_partitions(store, now - DAY, now)
        util = register(store, args.devices, now)
        ingest_start = now - args.ingest_s - 1
        t0 = time.perf_counter()
        day_rows = seed_day(store, args.devices, now - DAY, ingest_start)
        log(f"seeded {day_rows:,} minute rows in {time.perf_counter() - t0:.0f} s")
        rows, took = ingest(store, util, ingest_start, args.ingest_s)
        log(f"ingested {rows:,} 1 Hz rows in {took:.1f} s")
        day_rows += rows
        bare_fetch(store, now - DAY, now)  # the same cache state for everything after
        bare = bare_fetch(store, now - DAY, now)
        log(f"bare fetch {bare:.1f} s")
        # the hourly job has rolled up the day's hours as they closed (each keeps the detectors' summary of it)
        t0 = time.perf_counter()
        rollup(store, now - HOUR, since=now - DAY)
        log(f"rolled up the 23 hours before the last in {time.perf_counter() - t0:.0f} s (not timed)")
        t0 = time.perf_counter()
        rollup(store, now, since=now - HOUR)
        rollup_s = time.perf_counter() - t0
        log(f"rollup of the last hour {rollup_s:.1f} s")
        det = run_detect(url, now)
        log(f"detect {det}")
        # the same day judged from its samples alone, as before any hour is kept (a new store, another threshold)
        with store.engine.begin() as conn:
            conn.execute(text("DELETE FROM telemetry_hours"))
        raw = run_detect(url, now)
        log(f"detect from samples {raw}")
    finally:
        store.dispose()
        with admin.connect() as conn:
            conn.execute(text(f"DROP SCHEMA {schema} CASCADE"))
        admin.dispose()
    detect_s = det["detect_s"]
    print(json.dumps({
        "case": "fleet_scale", "devices": args.devices, "day_rows": day_rows,
        "ingest_rows_per_s": round(rows / took), "rollup_hour_s": round(rollup_s, 2),
        "detect_day_s": None if detect_s is None else round(detect_s, 1),
        "detect_peak_rss_mib": None if det["peak_rss_mib"] is None else round(det["peak_rss_mib"]),
        "bare_fetch_day_s": round(bare, 2),
        "detect_ratio": None if detect_s is None else round(detect_s / bare, 2),
        "findings": det["findings"], "detect_error": det.get("error"),
        "detect_from_samples_s": None if raw["detect_s"] is None else round(raw["detect_s"], 1),
        "detect_from_samples_rss_mib": None if raw["peak_rss_mib"] is None else round(raw["peak_rss_mib"]),
        "findings_from_samples": raw["findings"],
        "load_avg_1_5_15": [round(x, 1) for x in os.getloadavg()],  # the machine's load when it finished
    }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
