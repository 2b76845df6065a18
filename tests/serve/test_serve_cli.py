"""`fleetlens serve` on this host: the agent records it, the scheduler's first cycle runs, an agent that dies is
started again, and stopping is clean."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import func, select

from store.db import Store
from store.models import Device, DeviceSample, Host, Plan
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


@pytest.mark.slow
def test_serve_starts_its_agent_again_when_it_dies_and_stops_all_at_the_end(tmp_path):
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETLENS_")}
    env.update({"FLEETLENS_HOME": str(home), "FLEETLENS_SECRET": "serve-test", "FLEETLENS_FLUSH_INTERVAL_S": "1"})
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        serve = subprocess.Popen([FLEETLENS, "serve", "--no-ui", "--no-metrics", "--duration", "40"], env=env,
                                 stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        def agents() -> list:  # by its environment: this serve's home; the agent is the one running `agent`
            return [p for p in processes_of(home) if p.cmdline()[-1:] == ["agent"]]

        first = _wait(agents, serve, log)
        store = Store(f"sqlite:///{home / 'fleetlens.db'}")
        _wait(lambda: _samples(store), serve, log)
        first[0].kill()  # a crash: no stop of its own, nothing written at the end
        second = _wait(lambda: [p for p in agents() if p.pid != first[0].pid], serve, log)
        killed_at = time.time()
        assert second[0].environ().get("FLEETLENS_HOME") == str(home)
        _wait(lambda: _samples(store, after=killed_at + 1), serve, log)  # the new agent records again
        assert serve.wait(timeout=120) == 0, log.read_text()
    finally:
        if serve.poll() is None:
            serve.kill()
    said = log.read_text()
    assert "agent exited with code -9" in said and "agent started again (restart 1" in said, said
    assert list(processes_of(home)) == []


def _wait(predicate, serve: subprocess.Popen, log: Path, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert serve.poll() is None, f"serve ended early:\n{log.read_text()}"
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {predicate}:\n{log.read_text()}")


def _samples(store: Store, after: float = 0.0) -> int:
    with store.session() as s:
        return s.scalar(select(func.count()).select_from(DeviceSample).where(DeviceSample.ts > after))


def test_serve_refuses_a_dashboard_port_that_is_no_port_instead_of_restarting_the_dashboard(tmp_path):
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETLENS_")}
    env.update({"FLEETLENS_HOME": str(home), "FLEETLENS_SECRET": "serve-test", "FLEETLENS_UI_PORT": "70000"})
    result = subprocess.run([FLEETLENS, "serve", "--no-agent", "--no-metrics", "--duration", "5"], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "FLEETLENS_UI_PORT is '70000'" in result.stderr and "Traceback" not in result.stderr
    assert not (home / "dashboard.log").exists()  # no dashboard was started (and none again and again)
    assert list(processes_of(home)) == []
