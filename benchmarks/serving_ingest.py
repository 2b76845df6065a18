"""Serving ingest: requests per second one host's serving loops record and the agent stores, without losing any.

An agent (SdkHandlers behind the real socket server, its own process, a SQLite store; then, when FLEETLENS_TEST_PG_URL
or FLEETLENS_BENCH_PG_URL names a PostgreSQL database, the same on a fresh schema there) serves PROCS serving
processes, each recording REQUESTS requests of APPS applications as fast as it can through the SDK's serving mode
(collector.serving: per-minute histograms, flushed about once a second). The figure is requests stored per second of
wall time, from the first request to the last one in the store, and the store's counts must equal what was recorded.
The anchor, in the same run: the same SDK path with one message per request (what a per-request protocol costs). One
JSON line per database; the target is at least 10,000 requests/s with none lost. With --raw, the jobs and the agent
keep raw requests too (FLEETLENS_SERVING_RAW_REQUESTS): the line adds the raw rows stored (at most the cap) and
counted over it, which must add up to every request, and the wall time runs until they do.

Run: PYTHONPATH=. [FLEETLENS_TEST_PG_URL=postgresql+psycopg://...] python benchmarks/serving_ingest.py [--raw]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.pg_schema import bench_pg_url, scratch_schema  # noqa: E402
from store.db import Store  # noqa: E402
from store.serving import app_windows  # noqa: E402
from store.serving_raw import raw_counts  # noqa: E402
from store.settings import Settings  # noqa: E402

PROCS = 2
REQUESTS = 200_000  # per process
ANCHOR_REQUESTS = 3_000  # per process, one message each
APPS = 8
TARGET = 10_000.0

SERVE = """
import sys
from store.db import Store
from store.migrations import upgrade
from store.settings import Settings
from collector.sdk_handlers import SdkHandlers
from collector.socket_server import SocketServer
s = Settings(home=sys.argv[1], db_url=sys.argv[2] or None)
store = Store.from_settings(s); upgrade(store)
handlers = SdkHandlers(store, "bench-host", s, sync_interval_s=0.5)
with SocketServer(s.socket_path, handlers):
    print("ready", flush=True)
    sys.stdin.read()
handlers.close()
"""

LOOP = """
import sys, time
from collector.serving import ServingRecorder
from store.settings import Settings
home, wf, n, apps, per_message = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
rec = ServingRecorder(wf, settings=Settings(home=home), slos={f"app{i}": 0.05 for i in range(apps)})
names = [f"app{i}" for i in range(apps)]
t = time.time()
for i in range(n):
    a = t + i * 1e-4
    rec.record(names[i % apps], arrival=a, start=a + 1e-4, end=a + 1e-4 + 0.001 * (1 + i % 97), batch_size=4)
    if per_message:
        rec.flush(force=True)
rec.close()
print(rec.sent, rec.lost, flush=True)
"""


def stored(store: Store, wf: str) -> int:
    with store.session() as s:
        return sum(w.n + w.dropped for w in app_windows(s, 0.0, time.time() + 1e6, [wf]))


def raw_stored(store: Store, wf: str) -> tuple[int, int]:
    with store.session() as s:
        return raw_counts(s, wf)


def done(store: Store, wf: str, want: int, raw: bool) -> bool:
    return stored(store, wf) >= want and (not raw or sum(raw_stored(store, wf)) >= want)


def run(home: Path, store: Store, wf: str, n: int, per_message: bool, env: dict,
        raw: bool) -> tuple[float, int, int]:
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", LOOP, str(home), wf, str(n), str(APPS),
                               "1" if per_message else "0"], stdout=subprocess.PIPE, text=True, env=env)
             for _ in range(PROCS)]
    sent = lost = 0
    for p in procs:
        out, _ = p.communicate(timeout=1800)
        s, lo = out.split()
        sent, lost = sent + int(s), lost + int(lo)
    want = n * PROCS
    while not done(store, wf, want, raw) and time.perf_counter() - t0 < 600:
        time.sleep(0.1)
    return time.perf_counter() - t0, stored(store, wf), lost


def measure(db_url: str | None, backend: str, raw: bool = False) -> dict:
    env = dict(os.environ)
    env.pop("FLEETLENS_SERVING_RAW_REQUESTS", None)
    if raw:
        env["FLEETLENS_SERVING_RAW_REQUESTS"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp) / "h"
        home.mkdir()
        agent = subprocess.Popen([sys.executable, "-c", SERVE, str(home), db_url or ""], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True, env=env)
        try:
            assert agent.stdout.readline().strip() == "ready"
            store = Store.from_settings(Settings(home=home, db_url=db_url))
            wall, got, lost = run(home, store, "bench-serving", REQUESTS, False, env, raw)
            raw_kept, raw_over = raw_stored(store, "bench-serving")
            a_wall, a_got, a_lost = run(home, store, "bench-serving-anchor", ANCHOR_REQUESTS, True, env, raw)
            store.dispose()
        finally:
            agent.stdin.close()
            agent.wait(timeout=60)
    want = REQUESTS * PROCS
    rate, anchor = got / wall, a_got / a_wall
    raw_fields = {"raw_requests": raw}
    if raw:
        raw_fields.update(raw_cap=Settings().serving_raw_max_rows, raw_stored=raw_kept, raw_over_cap=raw_over)
    ok_raw = not raw or raw_kept + raw_over == want
    return {
        "benchmark": "serving_ingest", "database": backend, "processes": PROCS, "applications": APPS,
        "requests": want, "stored": got, "lost": lost, "requests_per_s": round(rate, 1), "wall_s": round(wall, 2),
        "anchor": "one message per request", "anchor_requests": ANCHOR_REQUESTS * PROCS, "anchor_stored": a_got,
        "anchor_requests_per_s": round(anchor, 1), "ratio_to_anchor": round(rate / anchor, 2),
        **raw_fields, "target_requests_per_s": TARGET,
        "meets_target": rate >= TARGET and got == want and lost == 0 and ok_raw,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--raw", action="store_true", help="keep raw requests too (capped per workflow, rest counted)")
    raw = ap.parse_args(argv).raw
    print(json.dumps(measure(None, "sqlite", raw)), flush=True)
    pg = bench_pg_url()
    if not pg:
        print("# no FLEETLENS_TEST_PG_URL: PostgreSQL line skipped", file=sys.stderr)
        return
    with scratch_schema(pg) as url:
        print(json.dumps(measure(url, "postgresql", raw)), flush=True)


if __name__ == "__main__":
    main()
