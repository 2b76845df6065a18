"""Helpers for the managed-job and migration tests: a real agent in a subprocess (cpu source), real torch
training jobs (collector.examples.train), and reading their progress back from the store and their logs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
from sqlalchemy import select

from enforcer.managed import ManagedJob
from enforcer.migration import MigrationOptions
from store.db import Store
from store.migrations import upgrade
from store.models import Action, Command, Device, Host, Placement, StepStat, Workflow
from store.settings import Settings, get_settings
from tests.collector.agent_helpers import wait_for
from tests.conftest import PROJECT_ROOT
from ui.serve.run import run_managed

TRAIN = [sys.executable, "-m", "collector.examples.train"]
# the job SDK talks to the agent often, and finds a restarted agent again quickly
JOB_ENV = {"FLEETLENS_SDK_FLUSH_INTERVAL_S": "0.1", "FLEETLENS_SDK_RETRY_S": "0.3", "PYTHONPATH": str(PROJECT_ROOT)}


class AgentProc:
    """`fleetlens agent` on the cpu source in a subprocess, with its own host id, on the test's FLEETLENS_HOME."""

    def __init__(self, home: Path, host_id: str | None = None, db_url: str | None = None,
                 hide: Path | None = None, **env: str) -> None:
        self.home = home
        self.hide = hide  # a folder this host cannot see (its own mount namespace): storage another host has
        self.host_id = host_id or f"host-{uuid.uuid4().hex[:8]}"
        self.env = {**os.environ, **JOB_ENV, "FLEETLENS_HOME": str(home), "FLEETLENS_HOST_ID": self.host_id,
                    "FLEETLENS_SOURCE": "cpu", "FLEETLENS_SAMPLE_INTERVAL_S": "0.5",
                    "FLEETLENS_FLUSH_INTERVAL_S": "1", **env}
        if db_url:
            self.env["FLEETLENS_DB_URL"] = db_url
        self.proc: subprocess.Popen | None = None
        self.log = home / f"agent-{self.host_id}.log"

    def start(self, store: Store, wait: bool = True, timeout: float = 60) -> AgentProc:
        self.home.mkdir(parents=True, exist_ok=True)
        out = open(self.log, "ab")
        command = [sys.executable, "-c", "import ui.cli; ui.cli.main()", "agent", "-v"]
        if self.hide is not None:  # an empty tmpfs over the folder, seen only by this agent and what it starts
            command = ["unshare", "--mount", "sh", "-c", 'mount -t tmpfs fleetlens-hidden "$0" && exec "$@"',
                       str(self.hide), *command]
        self.proc = subprocess.Popen(command, env=self.env, cwd=PROJECT_ROOT, stdout=out, stderr=subprocess.STDOUT)
        out.close()
        if wait:
            started = time.time()
            wait_for(lambda: self._registered(store, started), timeout=timeout, every=0.2)
            wait_for(lambda: (self.home / "agent.sock").exists(), timeout=30)
        return self

    def _registered(self, store: Store, since: float) -> bool:
        assert self.proc is not None and self.proc.poll() is None, self.log.read_text()[-3000:]
        with store.session() as s:
            host = s.get(Host, self.host_id)
            return host is not None and host.agent_pid == self.proc.pid and host.last_seen >= since

    def devices(self, store: Store) -> list[Device]:
        with store.session() as s:
            rows = list(s.scalars(select(Device).where(Device.host_id == self.host_id).order_by(Device.index)))
            s.expunge_all()
            return rows

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()


def train_cmd(steps: int, *extra: str, step_sleep: float = 0.02) -> list[str]:
    return [*TRAIN, "--steps", str(steps), "--step-sleep", str(step_sleep), *extra]


def step_rows(store: Store, workflow_id: str) -> list[StepStat]:
    with store.session() as s:
        rows = list(s.scalars(select(StepStat).where(StepStat.workflow_id == workflow_id)
                              .order_by(StepStat.ts_start, StepStat.first_step)))
        s.expunge_all()
        return rows


def last_step(store: Store, workflow_id: str) -> int:
    return max((r.last_step for r in step_rows(store, workflow_id)), default=-1)


def workflow(store: Store, workflow_id: str) -> Workflow:
    with store.session() as s:
        wf = s.get(Workflow, workflow_id)
        s.expunge_all()
        return wf


def action(store: Store, action_id: int) -> Action:
    with store.session() as s:
        a = s.get(Action, action_id)
        s.expunge_all()
        return a


def commands(store: Store, action_id: int) -> list[Command]:
    with store.session() as s:
        rows = list(s.scalars(select(Command).where(Command.action_id == action_id).order_by(Command.id)))
        s.expunge_all()
        return rows


def summaries(log_path: Path) -> list[dict[str, Any]]:
    """The JSON summary line every run of the training script printed to its log (one per process)."""
    out = []
    for line in Path(log_path).read_text(errors="replace").splitlines():
        if line.startswith("{") and '"event": "done"' in line:
            out.append(json.loads(line))
    return out


def pid_alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def assert_steps_cover(store: Store, workflow_id: str, total: int) -> None:
    """Every step 0..total-1 was reported by some run of the job (resumed runs may repeat steps, never skip)."""
    covered: set[int] = set()
    for r in step_rows(store, workflow_id):
        covered.update(range(r.first_step, r.last_step + 1))
    missing = sorted(set(range(total)) - covered)
    assert not missing, f"steps never reported: {missing[:20]}..."


@dataclass
class Rig:
    home: Path
    store: Store
    agent: AgentProc
    settings: Settings

    def launch(self, command: list[str], **options) -> ManagedJob:
        job, _ = run_managed(self.store, command, detach=True, settings=self.settings, movable=True,
                             cwd=PROJECT_ROOT, **options)
        return job

    def other_device(self, job: ManagedJob) -> int:
        return next(d.id for d in self.agent.devices(self.store) if d.id not in job.device_ids)

    def placement(self, workflow_id: str) -> Placement:
        with self.store.session() as s:
            row = s.scalar(select(Placement).where(Placement.workflow_id == workflow_id, Placement.state == "active"))
            s.expunge_all()
            return row


@pytest.fixture(name="rig")
def rig_fixture(fleet_home: Path) -> Iterator[Rig]:
    """A real agent (subprocess) on the test's FLEETLENS_HOME and SQLite store; jobs it ran are killed after."""
    settings = get_settings(fresh=True)
    settings.ensure_home()
    store = Store.from_settings(settings)
    upgrade(store)
    agent = AgentProc(fleet_home).start(store)
    rig = Rig(fleet_home, store, agent, settings.model_copy(update={"host_id": agent.host_id}))
    yield rig
    agent.stop()
    rig.agent.stop()  # the agent a test started in place of a killed one
    for proc in psutil.process_iter():  # jobs this test started that are still running
        try:
            if proc.environ().get("FLEETLENS_MANAGED") == agent.host_id:
                proc.kill()
        except psutil.Error:
            continue
    store.dispose()


FAST = MigrationOptions(checkpoint_timeout_s=20, command_grace_s=5, resume_timeout_s=40)
