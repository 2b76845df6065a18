"""`fleetlens serve` on this host: the agent records it, the scheduler's first cycle runs, and stopping is clean."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import select

from store.db import Store
from store.models import Device, Host, Plan
from ui.serve.processes import processes_of

FLEETLENS = str(Path(sys.executable).with_name("fleetlens"))


@pytest.mark.slow
def test_serve_runs_agent_and_scheduler_then_stops_everything(tmp_path):
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETLENS_")}
    env.update({"FLEETLENS_HOME": str(home), "FLEETLENS_SECRET": "serve-test", "FLEETLENS_FLUSH_INTERVAL_S": "1"})
    result = subprocess.run([FLEETLENS, "serve", "--no-ui", "--duration", "15"], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "enforcement dry run" in result.stdout
    store = Store(f"sqlite:///{home / 'fleetlens.db'}")
    with store.session() as s:
        assert s.scalar(select(Host.id)) is not None
        assert s.scalars(select(Device)).all()
        plan = s.scalar(select(Plan))  # the enforcement cycle ran once at start, as a dry run
        assert plan is not None and plan.applied is False
        assert plan.summary["outcome"]["mode"] == "dry_run"
    assert list(processes_of(home)) == []
