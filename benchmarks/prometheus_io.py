"""Prometheus in and out. Two JSON lines on stdout; progress on stderr.

1. import: `import_prometheus` of a day of the Alibaba GenAI recording (FLEETLENS_BENCH_CONTAINERS containers, 32 by
   default) from a real Prometheus (Debian's, backfilled with promtool), into PostgreSQL (FLEETLENS_TEST_PG_URL or
   FLEETLENS_BENCH_PG_URL; SQLite when neither is set), against the anchor: a bare fetch of the same series in the
   same run (the importer's queries over the whole range, one per metric, one after another, each answer decoded
   from JSON, nothing else; gzipped, as httpx and Grafana ask by default). Target: the import takes at most 1.5x
   the bare fetch. `importer_queries_fetch_s` is the fetch alone as the importer makes it (only the metrics with
   series, in its windows, uncompressed), to tell the fetch's share of the import from the writing's; the ratio
   stays against the whole-range fetch. `bare_fetch_uncompressed_s` / `ratio_to_uncompressed`: the same anchor
   asking for identity encoding, which on one machine is faster (Prometheus spends most of its CPU on gzip), so a
   reader can judge the import against either.
2. scrape: one GET of the agent's /metrics for 8 GPUs x 32 processes (tests/fakes/fake_pynvml behind the real nvml
   source; 256 sleeping children with FLEETLENS_WORKFLOW, so attribution is real), median of 50, against one
   sample of the same devices by the source (the anchor). Target: under 50 ms. The agent keeps a formatted answer
   until a new sample arrives (1 Hz), so most of these scrapes get it ready-made; `fresh_*` are scrapes made each
   right after a new sample, which format it (what a single Prometheus scraping every 15 s sees).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
from sqlalchemy import create_engine, text

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.collector_overhead import N_GPUS, PROCS_PER_GPU, fake_fleet  # noqa: E402
from collector.agent import Agent  # noqa: E402
from collector.dcgm_names import FIELDS, LEGACY  # noqa: E402
from collector.importers.prometheus import cyclic_gc_paused, import_prometheus, import_windows  # noqa: E402
from collector.importers.prometheus_http import PrometheusClient  # noqa: E402
from collector.recordings.openmetrics_writer import write_openmetrics  # noqa: E402
from collector.recordings.read import read_recording  # noqa: E402
from collector.sources.nvml import NvmlSource  # noqa: E402
from store.db import Store  # noqa: E402
from store.migrations import upgrade  # noqa: E402
from store.settings import Settings  # noqa: E402
from tests.conftest import FLEET  # noqa: E402
from tests.fakes.fake_pynvml import fleet  # noqa: E402
from tests.prometheus_server import backfill, free_port, prometheus  # noqa: E402

CONTAINERS = int(os.environ.get("FLEETLENS_BENCH_CONTAINERS", "32"))
STEP = 30.0
SCRAPES, FRESH = 50, 8


def progress(msg: str) -> None:
    print(f"[prometheus_io] {msg}", file=sys.stderr, flush=True)


# the anchor asks for dcgm-exporter's current names only: the 1.x names the importer also knows have no series here,
# and asking for them would only make the anchor slower
CURRENT = [f for f in FIELDS if f.name not in LEGACY]


def bare_fetch(url: str, start: float, end: float, *, compressed: bool = True) -> tuple[float, int]:
    """The importer's series at its step and with its query, one query per metric over the whole range, one after
    another, decoded and nothing more: (seconds, points). `compressed`: gzipped answers, as httpx (and Grafana) ask
    by default; the anchor. Uncompressed, as the importer asks, it is faster on one machine: reported beside it."""
    window = f"{round(STEP * 1000) - 1}ms"
    points = 0
    t0 = time.perf_counter()
    headers = {} if compressed else {"Accept-Encoding": "identity"}
    with httpx.Client(base_url=url, timeout=300, headers=headers) as client:
        for f in CURRENT:
            body = client.get("/api/v1/query_range", params={
                "query": f"last_over_time({f.name}[{window}])", "start": repr(start), "end": repr(end),
                "step": repr(STEP)}).json()
            points += sum(len(s["values"]) for s in body["data"]["result"])
    return time.perf_counter() - t0, points


def importer_queries_fetch(url: str, start: float, end: float, settings: Settings) -> tuple[float, int, int]:
    """The importer's own query set, fetched and decoded by its own client, nothing else: the metrics that have
    series in the range (one label-values call), then its windows (FLEETLENS_PROMETHEUS_WINDOW_S), each window's
    metrics queried 4 at a time, uncompressed, and decoded with orjson with the cyclic collector paused, one window
    after another; (seconds, points, query_range calls). The anchor (bare_fetch) asks every field over the whole
    range in one query each; this says how much of the import's time is the fetch as the importer makes it."""
    points = queries = 0
    t0 = time.perf_counter()
    with cyclic_gc_paused(), PrometheusClient(url, timeout_s=300, compress=settings.prometheus_compress) as client:
        names = client.names_present([f.name for f in FIELDS], start, end)
        for lo, hi in import_windows(start, end, STEP, settings):
            points += sum(len(s["values"]) for s in client.fetch(names, lo, hi, STEP))
            queries += len(names)
    return time.perf_counter() - t0, points, queries


def pg_store() -> tuple[Store | None, object]:
    pg = os.environ.get("FLEETLENS_BENCH_PG_URL") or os.environ.get("FLEETLENS_TEST_PG_URL")
    if not pg:
        return None, None
    schema = f"bench_{uuid.uuid4().hex[:8]}"
    admin = create_engine(Store(pg).url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f"CREATE SCHEMA {schema}"))
    sep = "&" if "?" in pg else "?"
    store = Store(f"{pg}{sep}options=-csearch_path%3D{schema}")
    upgrade(store)

    def drop() -> None:
        store.dispose()
        with admin.connect() as conn:
            conn.execute(text(f"DROP SCHEMA {schema} CASCADE"))
        admin.dispose()

    return store, drop


def import_line(tmp: Path) -> dict:
    rec = read_recording(FLEET, containers=CONTAINERS)
    write_openmetrics(rec, tmp / "fleet.om")
    progress(f"backfilling {CONTAINERS} containers x {(rec.end - rec.start) / 3600:.1f} h with promtool")
    backfill(tmp / "fleet.om", tmp / "data")
    (tmp / "fleet.om").unlink()
    store, drop = pg_store()
    database = "postgresql"
    if store is None:
        progress("no FLEETLENS_TEST_PG_URL: importing into SQLite")
        store, drop, database = Store(f"sqlite:///{tmp / 'bench.db'}"), None, "sqlite"
        upgrade(store)
    try:
        with prometheus(tmp / "prom", data_dir=tmp / "data") as prom:
            bare_fetch(prom.url, rec.start, rec.end)  # warm Prometheus's caches for both
            bare_s, points = bare_fetch(prom.url, rec.start, rec.end)
            progress(f"bare fetch {bare_s:.2f} s for {points} points; importing")
            settings = Settings(home=tmp)
            summary = import_prometheus(store, prom.url, since=rec.start, until=rec.end, step=STEP,
                                        settings=settings, now=rec.end + 60)
            again_s, _ = bare_fetch(prom.url, rec.start, rec.end)
            own_s, own_points, queries = importer_queries_fetch(prom.url, rec.start, rec.end, settings)
            plain_s = min(bare_fetch(prom.url, rec.start, rec.end, compressed=False)[0] for _ in range(2))
    finally:
        if drop is not None:
            drop()
        else:
            store.dispose()
    bare = min(bare_s, again_s)
    return {
        "case": "prometheus_import", "database": database, "containers": CONTAINERS, "step_s": STEP,
        "points": points, "device_samples": summary.device_samples, "process_samples": summary.process_samples,
        "import_s": round(summary.seconds, 3), "import_fetch_s": round(summary.fetch_s, 3),
        "bare_fetch_s": round(bare, 3), "bare_queries": len(CURRENT), "importer_queries": queries,
        "importer_queries_fetch_s": round(own_s, 3), "importer_queries_points": own_points,
        "ratio": round(summary.seconds / bare, 2),
        "bare_fetch_uncompressed_s": round(plain_s, 3), "ratio_to_uncompressed": round(summary.seconds / plain_s, 2),
        "samples_per_s": round((summary.device_samples + summary.process_samples) / summary.seconds),
        "target_ratio": 1.5, "meets_target": summary.seconds <= 1.5 * bare,
    }


def scrape_line(tmp: Path) -> dict:
    with fake_fleet() as fake:
        settings = Settings(home=tmp / "home", secret="bench", host_id="bench-host", metrics_port=free_port())
        settings.ensure_home()
        store = Store(settings.resolved_db_url)
        upgrade(store)
        source = NvmlSource(nvml=fake)
        agent = Agent(store, settings, source, sample_interval_s=1.0, flush_interval_s=2.0, serve_socket=False)
        agent.start()
        try:
            deadline = time.monotonic() + 30
            while (not agent.latest or not agent.stats.batches_written) and time.monotonic() < deadline:
                time.sleep(0.1)
            url = f"http://127.0.0.1:{agent.metrics_port}/metrics"
            times, size = [], 0
            with httpx.Client(timeout=30) as client:
                client.get(url)  # the first scrape reads teams and lanes from the store
                for _ in range(SCRAPES):
                    t0 = time.perf_counter()
                    size = len(client.get(url).content)
                    times.append(time.perf_counter() - t0)
                fresh = []
                for _ in range(FRESH):
                    seen = agent.latest
                    while agent.latest is seen:
                        time.sleep(0.005)
                    t0 = time.perf_counter()
                    client.get(url)
                    fresh.append(time.perf_counter() - t0)
            anchor = NvmlSource(nvml=fleet(N_GPUS, PROCS_PER_GPU))
            anchor.sample()  # GPM needs one sample before it reads metrics
            samples = []
            for _ in range(SCRAPES):
                t0 = time.perf_counter()
                anchor.sample()
                samples.append(time.perf_counter() - t0)
            anchor.close()
        finally:
            agent.stop()
            store.dispose()
    scrape_ms, sample_ms = statistics.median(times) * 1000, statistics.median(samples) * 1000
    fresh_ms = statistics.median(fresh) * 1000
    return {
        "case": "agent_metrics_scrape", "gpus": N_GPUS, "procs_per_gpu": PROCS_PER_GPU, "scrapes": SCRAPES,
        "scrape_ms_median": round(scrape_ms, 2), "scrape_ms_max": round(max(times) * 1000, 2), "bytes": size,
        "fresh_scrapes": FRESH, "fresh_scrape_ms_median": round(fresh_ms, 2),
        "one_source_sample_ms": round(sample_ms, 2), "ratio": round(scrape_ms / sample_ms, 2),
        "fresh_ratio": round(fresh_ms / sample_ms, 2), "target_ms": 50, "meets_target": scrape_ms < 50,
        "fresh_meets_target": fresh_ms < 50,
    }


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(import_line(Path(tmp))), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(scrape_line(Path(tmp))), flush=True)


if __name__ == "__main__":
    main()
