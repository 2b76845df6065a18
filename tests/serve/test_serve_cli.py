"""`fleetlens serve` on this host: the agent records it, the scheduler's first cycle runs, and stopping is clean."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from store.db import Store
from store.models import Device, Host, Plan
from tests.prometheus_server import free_port
from ui.serve.processes import processes_of

FLEETLENS = str(Path(sys.executable).with_name("fleetlens"))


@pytest.mark.slow
def test_serve_runs_agent_and_scheduler_then_stops_everything(tmp_path):
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETLENS_")}
    port = free_port()
    env.update({"FLEETLENS_HOME": str(home), "FLEETLENS_SECRET": "serve-test", "FLEETLENS_FLUSH_INTERVAL_S": "1",
                "FLEETLENS_METRICS_SERVE_PORT": str(port)})
    serve = subprocess.Popen([FLEETLENS, "serve", "--no-ui", "--duration", "30"], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        exported = ""
        deadline = time.monotonic() + 28  # the exporter is a fleetlens process of its own: seconds to start
        while "fleetlens_store_up 1.0" not in exported and time.monotonic() < deadline:
            try:
                exported = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
            except httpx.HTTPError:
                time.sleep(0.3)
        out, _ = serve.communicate(timeout=300)
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
    assert serve.returncode == 0, out
    assert "enforcement dry run" in out
    assert "fleetlens_store_up 1.0" in exported and "# TYPE fleetlens_devices gauge" in exported  # metrics-serve
    store = Store(f"sqlite:///{home / 'fleetlens.db'}")
    with store.session() as s:
        assert s.scalar(select(Host.id)) is not None
        assert s.scalars(select(Device)).all()
        plan = s.scalar(select(Plan))  # the enforcement cycle ran once at start, as a dry run
        assert plan is not None and plan.applied is False
        assert plan.summary["outcome"]["mode"] == "dry_run"
    assert list(processes_of(home)) == []
