"""Many agents at once against one PostgreSQL: 100 hosts' agents replaying the Alibaba GenAI telemetry at 1 Hz.

Each virtual host is a real `collector.agent.Agent` with its own host id, its own batching, its own spool folder
and its own store (connections opened per use: `pool_size=0`, as a fleet without a pooler runs its agents); several
of them share one worker process, as 2 cores must. The run is bounded (`--seconds`, at most 300) and loopback
only. At the end every worker stops its agents (the last batch flushed, or spooled and then sent), and the store
is counted: every row an agent took must be in it. One JSON line on stdout:

    {"case": "agents_load", "agents": 100, "seconds": N, "samples_sent": N, "samples_stored": N, "lost": 0,
     "write_p99_ms": x, ...}

`write_p99_ms` is the 99th percentile of one batch's write (COPY of its device and process rows), its anchor
`write_p50_ms` from the same run; `spool_peak_bytes` the largest any agent's spool grew, against its bound.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
from sqlalchemy import create_engine, func, select, text  # noqa: E402

from collector.agent import Agent  # noqa: E402
from collector.recordings.read import read_recording  # noqa: E402
from collector.sources.replay import ReplaySource  # noqa: E402
from store.db import Store  # noqa: E402
from store.migrations import upgrade  # noqa: E402
from store.models import Device, DeviceSample, Host, ProcessSample  # noqa: E402
from store.settings import Settings, get_settings  # noqa: E402

MAX_SECONDS = 300.0
SPOOL_MAX_BYTES = 64 * 1024 * 1024
MARK = "FLEETLENS_BENCH_AGENTS_LOAD"  # in every worker's environment, to find them whatever their command line


def progress(msg: str) -> None:
    print(f"[agents_load {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def host_ids(n: int, prefix: str) -> list[str]:
    return [f"{prefix}-{i:03d}" for i in range(n)]


# ---- one worker process: several virtual hosts ------------------------------------------------------------------

def worker(url: str, hosts: list[str], seconds: float, flush_s: float, command_s: float, home: Path) -> dict:
    rec = read_recording("alibaba", fleet_data_dir=get_settings().fleet_data_dir)
    recorded = sorted({d["host_id"] for d in rec.devices})
    settings = Settings(home=home, db_url=url, db_pool_size=0, sample_interval_s=1.0, flush_interval_s=flush_s,
                        spool_max_bytes=SPOOL_MAX_BYTES, source="replay")
    agents = []
    for host in hosts:
        played = recorded[int(host.rsplit("-", 1)[1]) % len(recorded)]
        source = ReplaySource(rec, host=played, uuid_prefix=host, speedup=60.0)
        agents.append(Agent(Store(url, pool_size=0), settings, source, host_id=host, serve_socket=False,
                            flush_interval_s=flush_s, command_interval_s=command_s))
    # real agents start at any time: spread the starts over one flush interval so the writes do not all coincide
    progress(f"worker {os.getpid()}: {len(agents)} agents built")
    t0 = time.monotonic()
    for i, agent in enumerate(agents):
        time.sleep(max(0.0, t0 + i * flush_s / len(agents) - time.monotonic()))
        agent.start()
    started = time.monotonic()
    spool_peak = 0
    while time.monotonic() - started < seconds:
        spool_peak = max(spool_peak, max(a.spool.size_bytes for a in agents))
        time.sleep(0.5)
    progress(f"worker {os.getpid()}: stopping")
    for agent in agents:
        agent.stop()
    progress(f"worker {os.getpid()}: stopped")
    # a batch spooled at the very end (the server busy or out of connections) is sent before the count
    deadline = time.monotonic() + 60
    while any(len(a.spool) for a in agents) and time.monotonic() < deadline:
        spool_peak = max(spool_peak, max(a.spool.size_bytes for a in agents))
        for agent in agents:
            if len(agent.spool):
                agent.flush()
        time.sleep(1.0)
    return {
        "hosts": hosts,
        "device_rows": sum(a.stats.device_rows for a in agents),
        "process_rows": sum(a.stats.process_rows for a in agents),
        "rows_dropped": sum(a.stats.rows_dropped + a.spool.dropped_rows for a in agents),
        "spooled_batches": sum(a.stats.batches_spooled for a in agents),
        "spool_left_rows": sum(a.spool.rows for a in agents),
        "spool_peak_bytes": spool_peak,
        "write_s": [w for a in agents for w in a.stats.write_s],
    }


# ---- the run ----------------------------------------------------------------------------------------------------

def stored(store: Store, hosts: list[str]) -> tuple[int, int, int]:
    """(device rows, process rows, hosts with device rows) the store holds for these hosts."""
    with store.session() as s:
        per_host = dict(s.execute(
            select(Device.host_id, func.count()).join(DeviceSample, DeviceSample.device_id == Device.id)
            .join(Host, Host.id == Device.host_id).where(Host.id.in_(hosts)).group_by(Device.host_id)).all())
        n_proc = s.scalar(select(func.count()).select_from(ProcessSample).where(ProcessSample.host_id.in_(hosts)))
    return int(sum(per_host.values())), int(n_proc), len(per_host)


def run(base_url: str, agents: int, procs: int, seconds: float, flush_s: float, command_s: float) -> dict:
    if not 0 < seconds <= MAX_SECONDS:
        raise SystemExit(f"--seconds must be in (0, {MAX_SECONDS:.0f}]")
    schema = f"fl_load_{uuid.uuid4().hex[:10]}"
    admin = create_engine(Store(base_url).url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f"CREATE SCHEMA {schema}"))
    sep = "&" if "?" in base_url else "?"
    url = f"{base_url}{sep}options=-csearch_path%3D{schema}"
    store = Store(url)
    workers: list[subprocess.Popen] = []
    mark = os.environ.get(MARK) or uuid.uuid4().hex
    try:
        upgrade(store)
        hosts = host_ids(agents, "load")
        groups = [hosts[i::procs] for i in range(procs)]
        with tempfile.TemporaryDirectory(prefix="fleetlens-agents-load-") as tmp:
            env = {**os.environ, MARK: mark, "PYTHONPATH": str(ROOT)}
            progress(f"{agents} agents in {procs} processes for {seconds:.0f} s, flushing every {flush_s:.0f} s")
            for k, group in enumerate(groups):
                workers.append(subprocess.Popen(
                    [sys.executable, __file__, "--worker", "--db-url", url, "--hosts", ",".join(group),
                     "--seconds", str(seconds), "--flush-s", str(flush_s), "--command-s", str(command_s),
                     "--home", str(Path(tmp) / f"w{k}")], env=env, stdout=subprocess.PIPE, text=True))
            results = []
            for w in workers:
                out, _ = w.communicate(timeout=seconds + 600)
                if w.returncode != 0:
                    raise SystemExit(f"a worker failed ({w.returncode}); see its log above")
                results.append(json.loads(out.strip().splitlines()[-1]))
        n_dev, n_proc, n_hosts = stored(store, hosts)
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()
        store.dispose()
        with admin.connect() as conn:
            conn.execute(text(f"DROP SCHEMA {schema} CASCADE"))
        admin.dispose()
    sent = sum(r["device_rows"] + r["process_rows"] for r in results)
    writes = np.array([w for r in results for w in r["write_s"]]) * 1000.0
    return {
        "case": "agents_load", "agents": agents, "processes": procs, "seconds": seconds, "flush_s": flush_s,
        "samples_sent": sent, "samples_stored": n_dev + n_proc, "lost": sent - (n_dev + n_proc),
        "device_rows": n_dev, "process_rows": n_proc, "hosts_with_rows": n_hosts,
        "rows_per_s": round((n_dev + n_proc) / seconds, 1),
        "writes": int(writes.size),
        "write_p50_ms": round(float(np.percentile(writes, 50)), 1) if writes.size else None,
        "write_p99_ms": round(float(np.percentile(writes, 99)), 1) if writes.size else None,
        "write_max_ms": round(float(writes.max()), 1) if writes.size else None,
        "batches_spooled": sum(r["spooled_batches"] for r in results),
        "spool_peak_bytes": max(r["spool_peak_bytes"] for r in results),
        "spool_bound_bytes": SPOOL_MAX_BYTES,
        "spool_left_rows": sum(r["spool_left_rows"] for r in results),
        "rows_dropped": sum(r["rows_dropped"] for r in results),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=100)
    ap.add_argument("--procs", type=int, default=4, help="worker processes the virtual hosts are spread over")
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--flush-s", type=float, default=10.0, help="the agents' write interval (their default: 10)")
    ap.add_argument("--command-s", type=float, default=5.0, help="how often each agent polls for commands")
    ap.add_argument("--db-url", default=os.environ.get("FLEETLENS_TEST_PG_URL",
                                                       "postgresql+psycopg://postgres@127.0.0.1:5432/test"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--hosts", default="", help=argparse.SUPPRESS)
    ap.add_argument("--home", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        out = worker(args.db_url, args.hosts.split(","), args.seconds, args.flush_s, args.command_s, Path(args.home))
        print(json.dumps(out), flush=True)
        return 0
    print(json.dumps(run(args.db_url, args.agents, args.procs, args.seconds, args.flush_s, args.command_s)),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
