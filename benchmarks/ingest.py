"""Device samples written per second by store.ingest.write_samples against a plain ORM add_all, SQLite and PostgreSQL.

Prints one JSON line per database: rows/s for both paths on the same rows, the ratio, and the peak memory
(ru_maxrss growth) of streaming a 1,000,000-sample batch through write_samples.
Set FLEETLENS_TEST_PG_URL (or FLEETLENS_BENCH_PG_URL) for the PostgreSQL line.
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.pg_schema import bench_pg_url, scratch_schema  # noqa: E402
from store.db import Store  # noqa: E402
from store.ingest import write_samples  # noqa: E402
from store.migrations import upgrade  # noqa: E402
from store.models import DeviceSample  # noqa: E402
from store.registry import DeviceSpec, register_devices, register_host  # noqa: E402
from store.samples import DEVICE_SAMPLE_COLUMNS  # noqa: E402

ROWS = 200_000
STREAM_ROWS = 1_000_000
BASELINE_ROWS = 20_000


def _rows(device_ids: list[int], n: int, start: float = 0.0):
    k = len(device_ids)
    for i in range(n):
        yield {
            "device_id": device_ids[i % k], "ts": start + i // k, "gpu_util": 0.5, "mem_util": 0.25,
            "mem_used": 1 << 30, "mem_total": 80 << 30, "power_w": 250.0, "temperature_c": 60.0,
            "sm_clock_mhz": 1400.0,
        }


def _prepare(store: Store) -> list[int]:
    upgrade(store)
    with store.session() as s:
        register_host(s, "bench", hostname="bench", source="replay")
        ids = register_devices(s, "bench", [DeviceSpec(i, f"bench-{i}", "bench", 80 << 30) for i in range(8)],
                               source="replay")
    return list(ids.values())


def _maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _rate(store: Store, rows: list[dict], write) -> float:
    t0 = time.perf_counter()
    write(store, rows)
    return len(rows) / (time.perf_counter() - t0)


def _orm_add_all(store: Store, rows: list[dict]) -> None:
    with store.session() as s:
        s.add_all(DeviceSample(**row) for row in rows)


def measure(store: Store, label: str) -> dict:
    devices = _prepare(store)
    # The stream first, before this process holds any row lists: RSS growth is the stream's own.
    before = _maxrss_mib()
    t0 = time.perf_counter()
    write_samples(store, _rows(devices, STREAM_ROWS, start=2e6))
    stream_rate = STREAM_ROWS / (time.perf_counter() - t0)
    stream_growth = _maxrss_mib() - before

    # The machine is shared: the median of three runs of each, interleaved, on the same rows. Rows come as the
    # agent makes them (lists in column order) and, for callers that build dicts, as dicts.
    ours, ours_dicts, baseline = [], [], []
    for k in range(3):
        rows = list(_rows(devices, ROWS, start=1e7 * (k + 1)))
        ours.append(_rate(store, [[row.get(c) for c in DEVICE_SAMPLE_COLUMNS] for row in rows], write_samples))
        ours_dicts.append(_rate(store, list(_rows(devices, ROWS, start=1e7 * (k + 1) + 2e6)), write_samples))
        baseline.append(_rate(store, list(_rows(devices, BASELINE_ROWS, start=1e7 * (k + 1) + 5e6)), _orm_add_all))
    ours_rate, dict_rate, base_rate = (statistics.median(x) for x in (ours, ours_dicts, baseline))
    return {
        "bench": "ingest", "db": label, "rows": ROWS, "rows_per_s": round(ours_rate),
        "dict_rows_per_s": round(dict_rate), "orm_add_all_rows_per_s": round(base_rate),
        "ratio": round(ours_rate / base_rate, 1), "dict_ratio": round(dict_rate / base_rate, 1),
        "stream_rows": STREAM_ROWS, "stream_rows_per_s": round(stream_rate),
        "stream_peak_rss_growth_mib": round(stream_growth, 1),
        "target_rows_per_s": 50_000 if label == "sqlite" else 100_000, "target_ratio": 10,
    }


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(measure(Store(f"sqlite:///{Path(tmp) / 'bench.db'}"), "sqlite")), flush=True)
    pg = bench_pg_url()
    if not pg:
        print("# no FLEETLENS_TEST_PG_URL: PostgreSQL line skipped", file=sys.stderr)
        return
    with scratch_schema(pg) as url:
        store = Store(url)
        try:
            print(json.dumps(measure(store, "postgresql")), flush=True)
        finally:
            store.dispose()


if __name__ == "__main__":
    main()
