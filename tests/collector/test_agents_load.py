"""100 hosts' agents at once against one PostgreSQL (benchmarks/agents_load.py, shortened): every row an agent
took is in the store, every host wrote, nothing was dropped or left in a spool, and no worker outlives the run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import psutil
import pytest

from tests.conftest import PROJECT_ROOT, pg_base_url

pytestmark = [pytest.mark.pg, pytest.mark.slow]

BENCH = PROJECT_ROOT / "benchmarks" / "agents_load.py"
MARK = "FLEETLENS_BENCH_AGENTS_LOAD"


def marked(mark: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(MARK) == mark:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def test_a_hundred_agents_lose_no_sample() -> None:
    mark = uuid.uuid4().hex
    env = {**os.environ, MARK: mark, "PYTHONPATH": str(PROJECT_ROOT)}
    try:
        proc = subprocess.run([sys.executable, str(BENCH), "--agents", "100", "--procs", "2", "--seconds", "20",
                               "--flush-s", "5", "--db-url", pg_base_url()], env=env, capture_output=True,
                              text=True, timeout=600)
    finally:
        left = marked(mark)
        for p in left:
            p.kill()
    assert left == [], "agent workers outlived the run"
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["case"] == "agents_load" and out["agents"] == 100
    assert out["hosts_with_rows"] == 100
    # 100 hosts of ~8 devices at 1 Hz for at least 20 s, each device reading with its process reading
    assert out["device_rows"] >= 100 * 7 * 20 and out["process_rows"] > 0
    assert out["samples_stored"] == out["samples_sent"] and out["lost"] == 0, out
    assert out["rows_dropped"] == 0 and out["spool_left_rows"] == 0
    assert out["spool_peak_bytes"] <= out["spool_bound_bytes"]
    assert out["writes"] >= 100 * 3 and out["write_p99_ms"] is not None
