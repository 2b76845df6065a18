"""SIGINT and SIGTERM stop `fleetlens agent`, `serve` and `ui` (exit 130 or 143) with their threads and children,
but never a user's training job: the job goes on, and the next agent on the host takes it up again."""

from __future__ import annotations

import signal
import sys
import uuid
from pathlib import Path

import psutil
import pytest
from sqlalchemy import func, select

from collector.launch import find_job_processes
from store.db import Store
from store.migrations import upgrade
from store.models import Device, Placement, StepStat, Workflow
from store.settings import get_settings
from tests.procs import processes_under
from tests.serve.stop_helpers import SIGNALS, clean_env, free_port, port_answers, start, stop, tail, wait_for
from ui.serve.run import run_managed

STEPS = 600


def _sig_id(sig: int) -> str:
    return signal.Signals(sig).name


@pytest.fixture
def host(fleet_home: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, dict[str, str], Store]:
    """A host of the test's own: (host id, the environment its commands run with, its store)."""
    host_id = f"stop-{uuid.uuid4().hex[:8]}"
    env = clean_env(fleet_home, FLEETLENS_HOST_ID=host_id, FLEETLENS_SOURCE="cpu", FLEETLENS_SAMPLE_INTERVAL_S="0.5",
                    FLEETLENS_FLUSH_INTERVAL_S="1", FLEETLENS_UI_PORT=str(free_port()),
                    FLEETLENS_METRICS_SERVE_PORT=str(free_port()),
                    FLEETLENS_SDK_RETRY_S="1")  # a job finds the next agent within a second
    for key, value in env.items():
        if key.startswith("FLEETLENS_"):
            monkeypatch.setenv(key, value)
    settings = get_settings(fresh=True)
    settings.ensure_home()
    store = Store.from_settings(settings)
    upgrade(store)
    yield host_id, env, store
    store.dispose()


def _devices(store: Store, host_id: str) -> int:
    with store.session() as s:
        return s.scalar(select(func.count()).select_from(Device).where(Device.host_id == host_id))


def _last_step(store: Store, workflow_id: str, pid: int) -> int:
    with store.session() as s:
        return s.scalar(select(func.max(StepStat.last_step)).where(StepStat.workflow_id == workflow_id,
                                                                   StepStat.pid == pid)) or -1


def _launch(store: Store) -> tuple[str, int]:
    """A real torch job in a lane, started detached by the host's agent: (workflow id, pid)."""
    command = [sys.executable, "-m", "collector.examples.train", "--mode", "tiny", "--steps", str(STEPS),
               "--step-sleep", "0.04", "--log-every", "10"]
    job, _ = run_managed(store, command, detach=True, settings=get_settings(), lane="auto", util=0.3,
                         mem_bytes=256 * 2**20, steps=STEPS, name="kept")
    return job.workflow_id, int(job.pid)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# The agent takes SIGINT and SIGTERM with one handler (Agent.run); SIGINT is sent to an agent started with it ignored,
# as a script's background job is, so the handler must have been put in place over the inherited SIG_IGN.
@pytest.mark.slow
@pytest.mark.parametrize(("sig", "sigint"), [(signal.SIGTERM, "default"), (signal.SIGINT, "ignored")],
                         ids=["SIGTERM", "SIGINT-ignored"])
def test_a_stopped_agent_leaves_its_job_running_and_the_next_agent_takes_it_up(host, tmp_path, sig, sigint):
    host_id, env, store = host
    log1, log2 = tmp_path / "agent1.log", tmp_path / "agent2.log"
    first = start(["agent"], env, log1, sigint=sigint)
    wait_for("devices registered", lambda: _devices(store, host_id), first, log1)
    workflow, pid = _launch(store)
    wait_for("the job's steps in the store", lambda: _last_step(store, workflow, pid) >= 20, first, log1)

    code, _ = stop(first, sig, log1)
    assert code == 128 + sig, tail(log1)
    # the job lives on, found by its environment, and trains with no agent (its own log shows the steps)
    assert [p.pid for p in find_job_processes(workflow, host_id)] == [pid]
    stored = _last_step(store, workflow, pid)
    job_log = get_settings().home / "logs" / f"{workflow}.log"
    wait_for("steps while no agent runs", lambda: any(
        int(line.split()[2].split("/")[0]) > stored + 20
        for line in job_log.read_text().splitlines() if line.startswith("train: step ")), _Running(pid), job_log)

    second = start(["agent"], env, log2)
    # the new agent takes the job up: its steps keep arriving, from the same process, past where they were
    wait_for("steps through the new agent", lambda: _last_step(store, workflow, pid) > stored + 20, second, log2)
    assert "took up managed job " + workflow in tail(log2, 50_000)
    # and when the job finishes, the new agent ends its placement
    wait_for("the job's end", lambda: not _alive(pid), second, log2, timeout=300)
    wait_for("the placement ended", lambda: _placement_ended(store, workflow), second, log2)
    with store.session() as s:
        assert s.get(Workflow, workflow).state == "finished"
        steps = s.execute(select(StepStat.first_step, StepStat.last_step).where(StepStat.workflow_id == workflow)
                          .order_by(StepStat.first_step)).all()
    assert steps[0][0] == 0 and steps[-1][1] == STEPS - 1  # every step of the run, one process, counted once
    for (_, last), (first_step, _) in zip(steps, steps[1:], strict=False):
        assert first_step == last + 1

    code, _ = stop(second, signal.SIGTERM, log2)
    assert code == 143
    assert processes_under(get_settings().home) == []


class _Running:
    """Stands in for a Popen in wait_for: the job's process, while no agent runs."""

    def __init__(self, pid: int) -> None:
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        return None if _alive(self.pid) else -1


def _placement_ended(store: Store, workflow: str) -> bool:
    with store.session() as s:
        states = set(s.scalars(select(Placement.state).where(Placement.workflow_id == workflow)))
    return states == {"ended"}


@pytest.mark.slow
@pytest.mark.parametrize("sig", SIGNALS, ids=_sig_id)
def test_serve_stops_its_agent_exporter_and_dashboard_but_not_the_jobs(host, tmp_path, sig):
    host_id, env, store = host
    log = tmp_path / "serve.log"
    serve = start(["serve"], env, log)
    wait_for("devices registered", lambda: _devices(store, host_id), serve, log)
    wait_for("the dashboard", lambda: port_answers(int(env["FLEETLENS_UI_PORT"])), serve, log)
    workflow, pid = _launch(store)
    wait_for("the job's steps", lambda: _last_step(store, workflow, pid) >= 0, serve, log)
    home = get_settings().home
    assert len(processes_under(home)) >= 4  # agent, exporter, dashboard, job

    code, _ = stop(serve, sig, log)
    assert code == 128 + sig, tail(log)
    left = processes_under(home)
    # the agent, the metrics exporter and the dashboard are gone; the training job alone is left, still running
    assert [p.pid for p in left] == [pid], [p.cmdline() for p in left]
    assert not port_answers(int(env["FLEETLENS_UI_PORT"]))
    psutil.Process(pid).terminate()
    psutil.wait_procs([psutil.Process(pid)], timeout=15)


@pytest.mark.slow
@pytest.mark.parametrize(("sig", "sigint"), [(signal.SIGINT, "default"), (signal.SIGTERM, "default"),
                                             (signal.SIGINT, "ignored")], ids=["SIGINT", "SIGTERM", "SIGINT-ignored"])
def test_ui_stops_the_dashboard_on_a_signal(host, tmp_path, sig, sigint):
    _, env, _ = host
    log, port = tmp_path / "ui.log", free_port()
    ui = start(["ui", "--port", str(port), "--address", "127.0.0.1"], env, log, sigint=sigint)
    wait_for("the dashboard", lambda: port_answers(port), ui, log, timeout=120)
    code, _ = stop(ui, sig, log)
    assert code == 128 + sig, tail(log)
    assert processes_under(get_settings().home) == []
    assert not port_answers(port)


def test_wait_for_names_what_it_waited_for(tmp_path):
    """The helpers' own failure path: a command that exits while a phase is awaited is reported, with its log."""
    log = tmp_path / "x.log"
    proc = start(["no-such-command"], clean_env(tmp_path / "home"), log)
    proc.wait(timeout=60)
    with pytest.raises(AssertionError, match="exited with 2 while waiting for nothing"):
        wait_for("nothing", lambda: False, proc, log)
