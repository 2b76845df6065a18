"""Raw serving requests at the cap: what keeping each workflow's newest rows costs under a steady stream of writes.

A workflow's table is first filled to the cap (FLEETLENS_SERVING_RAW_MAX_ROWS' default, 100,000 rows); then BATCHES
writes of BATCH rows (the SDK's RAW_PER_MESSAGE) each go through `store.serving_raw.write_raw`, which inserts them
and deletes as many of the oldest rows. The anchor, in the same run and on the same rows: the same writes with a
cap they never reach (inserts only). The figure is rows per second at the cap; the target is the serving ingest's,
10,000 requests/s from one host, every row either stored or counted. One JSON line per database (SQLite; then
PostgreSQL on a scratch schema when FLEETLENS_BENCH_PG_URL or FLEETLENS_TEST_PG_URL names one).

Run: PYTHONPATH=. [FLEETLENS_TEST_PG_URL=postgresql+psycopg://...] python benchmarks/serving_raw.py
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.pg_schema import bench_pg_url, scratch_schema  # noqa: E402
from collector.serving import RAW_PER_MESSAGE  # noqa: E402
from store.db import Store  # noqa: E402
from store.migrations import upgrade  # noqa: E402
from store.serving_raw import raw_counts, write_raw  # noqa: E402
from store.settings import Settings  # noqa: E402
from store.workflows import upsert_workflow  # noqa: E402

CAP = Settings().serving_raw_max_rows
BATCH = RAW_PER_MESSAGE
BATCHES = 40
TARGET = 10_000.0


def _rows(n: int, start: float) -> list[dict]:
    return [{"app": "a", "arrival": start + i * 1e-3, "wait_s": 0.001, "exec_s": 0.01, "latency_s": 0.011,
             "batch_size": 1} for i in range(n)]


def _writes(url: str, cap: int) -> tuple[float, tuple[int, int]]:
    """(rows per second over the timed writes, (stored, counted over the cap) after them)."""
    store = Store(url)
    try:
        upgrade(store)
        with store.session() as s:
            upsert_workflow(s, "svc", id_source="env")
        t = 0.0
        for _ in range(CAP // BATCH):  # fill to the cap, untimed
            with store.session() as s:
                write_raw(s, "svc", _rows(BATCH, t), cap)
            t += BATCH * 1e-3
        t0 = time.perf_counter()
        for _ in range(BATCHES):
            with store.session() as s:
                write_raw(s, "svc", _rows(BATCH, t), cap)
            t += BATCH * 1e-3
        rate = BATCH * BATCHES / (time.perf_counter() - t0)
        with store.session() as s:
            return rate, raw_counts(s, "svc")
    finally:
        store.dispose()


def measure(make_url, database: str) -> dict:
    with make_url() as url:
        rate, (stored, over) = _writes(url, CAP)
    with make_url() as url:
        anchor, _ = _writes(url, 10**12)
    sent = (CAP // BATCH + BATCHES) * BATCH
    return {"benchmark": "serving_raw", "database": database, "cap": CAP, "batch": BATCH, "batches": BATCHES,
            "rows_per_s_at_cap": round(rate), "stored": stored, "counted_over_cap": over,
            "anchor": "the same inserts below the cap", "anchor_rows_per_s": round(anchor),
            "ratio_to_anchor": round(rate / anchor, 3), "target_rows_per_s": TARGET,
            "meets_target": rate >= TARGET and stored == CAP and stored + over == sent}


@contextmanager
def _sqlite_url() -> Iterator[str]:
    with tempfile.TemporaryDirectory() as folder:
        yield f"sqlite:///{folder}/raw.db"


def main() -> None:
    print(json.dumps(measure(_sqlite_url, "sqlite")), flush=True)
    pg = bench_pg_url()
    if not pg:
        print("# no FLEETLENS_TEST_PG_URL: PostgreSQL line skipped", file=sys.stderr)
        return
    print(json.dumps(measure(lambda: scratch_schema(pg), "postgresql")), flush=True)


if __name__ == "__main__":
    main()
