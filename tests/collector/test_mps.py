"""MPS supervision against a stand-in nvidia-cuda-mps-control on PATH that records what it is told: start with its
folders, each lane's thread percentage, stop when no lane needs it, restart after it dies, a missing binary, a
share too small for MPS; and the agent running it from the lanes in the store."""

from __future__ import annotations

import json
import os
import signal
import stat
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from sqlalchemy import select, update

from collector.agent import Agent
from collector.launch import job_env
from collector.mps import MpsSupervisor, thread_percentage
from store.db import Store
from store.models import HostEvent, Lane, Placement
from store.registry import DeviceSpec, busy_gpu_lanes, register_devices, register_host
from store.settings import Settings
from store.workflows import upsert_workflow
from tests.collector.agent_helpers import StubSource, wait_for
from ui.dashboard import queries

HOST = "mps-host"

# The stand-in: `-f` is the daemon (records its start and folders, keeps a pid file, opens `control` in its pipe
# folder when it takes commands, after STANDIN_READY_DELAY_S: a slow start, and runs until killed or told to quit);
# without arguments it is a control client (records each stdin line, keeps the default thread percentage it is told
# in the pipe folder, as the daemon would hold it; `quit` ends the daemon, as the real one does).
STAND_IN = """#!{python}
import json, os, signal, sys, time
record = {record!r}
def note(**what):
    with open(record, "a") as f:
        f.write(json.dumps(what) + "\\n")
pipe = os.environ["CUDA_MPS_PIPE_DIRECTORY"]
if sys.argv[1:] == ["-f"]:
    note(event="daemon", pid=os.getpid(), pipe=pipe, log=os.environ["CUDA_MPS_LOG_DIRECTORY"])
    with open(os.path.join(pipe, "standin.pid"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(float(os.environ.get("STANDIN_READY_DELAY_S", "0")))
    open(os.path.join(pipe, "control"), "w").close()  # ready for commands, like the real daemon's pipe
    def leave(*_):
        os.unlink(os.path.join(pipe, "control"))
        sys.exit(0)
    signal.signal(signal.SIGTERM, leave)
    while True:
        time.sleep(0.05)
else:
    for line in sys.stdin:
        note(event="command", line=line.strip(), argv=sys.argv[1:])
        words = line.split()
        if words[:1] == ["set_default_active_thread_percentage"]:
            with open(os.path.join(pipe, "default"), "w") as f:
                f.write(words[1])
        if line.strip() == "quit":
            os.kill(int(open(os.path.join(pipe, "standin.pid")).read()), signal.SIGTERM)
"""


class StandIn:
    """The stand-in's folder (put on PATH) and what it recorded."""

    def __init__(self, tmp_path: Path) -> None:
        self.bin = tmp_path / "bin"
        self.record = tmp_path / "mps-record.jsonl"
        self.bin.mkdir()

    def install(self) -> Path:
        path = self.bin / "nvidia-cuda-mps-control"
        path.write_text(STAND_IN.format(python=sys.executable, record=str(self.record)))
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
        return path

    def events(self, kind: str | None = None) -> list[dict]:
        if not self.record.exists():
            return []
        rows = [json.loads(line) for line in self.record.read_text().splitlines()]
        return [r for r in rows if kind is None or r["event"] == kind]

    def commands(self) -> list[str]:
        """What the daemon was told, less the server-list queries that follow a new default."""
        return [r["line"] for r in self.events("command") if r["line"] != "get_server_list"]


def _daemons_of(pipe_dir: Path) -> list[psutil.Process]:
    """Live processes serving this pipe folder, found by their environment (how a leftover would show)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("CUDA_MPS_PIPE_DIRECTORY") == str(pipe_dir) and proc.status() != "zombie":
                found.append(proc)
        except psutil.Error:
            continue
    return found


@pytest.fixture
def standin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fleet_home: Path) -> Iterator[StandIn]:
    s = StandIn(tmp_path)
    monkeypatch.setenv("PATH", f"{s.bin}{os.pathsep}{os.environ['PATH']}")
    yield s
    left = _daemons_of(Settings().mps_pipe_dir)
    for proc in left:
        proc.kill()
    psutil.wait_procs(left, timeout=10)
    assert not left, f"MPS daemons left running: {[p.pid for p in left]}"


@pytest.fixture
def host_store(sqlite_store: Store) -> Store:
    with sqlite_store.session() as session:
        register_host(session, HOST, hostname="h", source="nvml")
    return sqlite_store


def _supervisor(store: Store | None = None) -> MpsSupervisor:
    settings = Settings()
    return MpsSupervisor(settings.mps_binary, settings.mps_pipe_dir, settings.mps_log_dir, store=store, host_id=HOST)


def _host_events(store: Store) -> list[tuple[str, str]]:
    with store.session() as session:
        return [(e.level, e.message) for e in session.scalars(select(HostEvent).order_by(HostEvent.id))]


def test_starts_under_home_sets_the_lanes_percentages_and_stops_when_no_lane_needs_it(standin, host_store,
                                                                                      fleet_home) -> None:
    standin.install()
    sup = _supervisor(host_store)
    sup.check({1: 0.5, 2: 0.25})
    (daemon,) = standin.events("daemon")
    assert daemon["pipe"] == str(fleet_home / "mps" / "pipe") and daemon["log"] == str(fleet_home / "mps" / "log")
    assert daemon["pid"] == sup.proc.pid and sup.state == "running"
    assert sup.percentages == {1: 50, 2: 25}
    # the daemon's default is the largest lane's: a client's own percentage can only lower it (NVIDIA's rule), so
    # each lane gets its own share, and a client without its lane's variable no more than the largest lane
    assert standin.commands() == ["set_default_active_thread_percentage 50"]
    sup.check({1: 0.5, 2: 0.25})
    assert standin.commands() == ["set_default_active_thread_percentage 50"]  # nothing changed: nothing sent
    sup.check({2: 0.25})
    assert standin.commands()[-1] == "set_default_active_thread_percentage 25" and sup.percentages == {2: 25}
    proc = sup.proc
    sup.check({})
    assert standin.commands()[-1] == "quit" and proc.poll() is not None and sup.proc is None
    assert sup.state == "stopped" and not _daemons_of(fleet_home / "mps" / "pipe")
    events = _host_events(host_store)
    assert events[0][0] == "info" and "started" in events[0][1] and "1: 50 %, 2: 25 %" in events[0][1]
    assert events[-1] == ("info", "MPS control daemon stopped: no lane on this host needs it any more")
    sup.check({})
    assert len(standin.events("daemon")) == 1 and standin.commands().count("quit") == 1


def test_a_daemon_that_dies_is_restarted_and_said(standin, host_store, fleet_home) -> None:
    standin.install()
    sup = _supervisor(host_store)
    sup.check({4: 0.3})
    first = sup.proc
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    sup.check({4: 0.3})
    daemons = standin.events("daemon")
    assert len(daemons) == 2 and daemons[1]["pid"] == sup.proc.pid != first.pid
    assert sup.restarts == 1 and sup.state == "running"
    # the new daemon is told the percentage again
    assert standin.commands() == ["set_default_active_thread_percentage 30"] * 2
    levels_messages = _host_events(host_store)
    died = [m for level, m in levels_messages if level == "error"]
    assert died == ["the MPS control daemon died (exit status -9); restarting it (restart 1); lanes' jobs keep "
                    "running meanwhile"]
    assert any(level == "warning" and "restarted" in m for level, m in levels_messages)
    shown = queries.host_events(host_store)  # what the dashboard's Fleet page lists, newest first
    assert list(shown.columns) == ["ts", "host", "kind", "level", "message"]
    assert (shown.host == HOST).all() and (shown.kind == "mps").all() and "died" in " ".join(shown.message)
    sup.close()
    assert not _daemons_of(fleet_home / "mps" / "pipe")


def test_a_daemon_left_by_a_killed_agent_is_taken_over_and_stopped_when_no_lane_needs_it(standin, host_store,
                                                                                        fleet_home) -> None:
    standin.install()
    pipe = fleet_home / "mps" / "pipe"
    killed = _supervisor(host_store)  # an agent that is then SIGKILLed: nothing of it stops its daemon
    killed.check({4: 0.3})
    left = killed.proc
    sup = _supervisor(host_store)  # the agent started again on the same home; its lane's job runs on
    sup.check({4: 0.3, 5: 0.6})
    # taken over, not replaced: the earlier agent's lane jobs are its clients; told the lanes' percentages again
    assert sup.proc.pid == left.pid and len(standin.events("daemon")) == 1 and sup.state == "running"
    assert standin.commands()[-1] == "set_default_active_thread_percentage 60"
    assert [p.pid for p in _daemons_of(pipe)] == [left.pid]
    assert any("an earlier agent left running" in m for level, m in _host_events(host_store) if level == "warning")
    sup.check({})
    assert standin.commands()[-1] == "quit" and not _daemons_of(pipe) and not (pipe / "control").exists()
    # an agent that comes back when no lane needs MPS any more stops what the one before it left
    killed.check({4: 0.3})
    _supervisor(host_store).check({})
    assert not _daemons_of(pipe) and standin.commands()[-1] == "quit"


def test_a_leftover_daemon_that_takes_no_commands_is_killed_before_a_new_one_starts(standin, host_store,
                                                                                     fleet_home) -> None:
    standin.install()
    pipe = fleet_home / "mps" / "pipe"
    killed = _supervisor(host_store)
    killed.check({4: 0.3})
    left = killed.proc
    (pipe / "control").unlink()  # it cannot be told anything
    sup = _supervisor(host_store)
    sup.check({4: 0.3})
    assert left.wait(timeout=5) is not None and sup.proc.pid != left.pid
    assert [p.pid for p in _daemons_of(pipe)] == [sup.proc.pid]
    sup.close()


def test_a_daemon_killed_or_dead_leaves_no_control_pipe_for_a_launch_to_trust(standin, host_store,
                                                                             fleet_home) -> None:
    standin.install()
    control = fleet_home / "mps" / "pipe" / "control"
    sup = _supervisor(host_store)
    sup.check({4: 0.3})
    os.kill(sup.proc.pid, signal.SIGKILL)  # dies with its pipe in place, and its lane's job ends meanwhile
    sup.proc.wait()
    sup.check({})
    assert not control.exists()  # wait_for_mps_pipe would let a new lane job start outside MPS


DEAF_DAEMON = """#!{python}
import os, subprocess, sys, time
pipe = os.environ["CUDA_MPS_PIPE_DIRECTORY"]
if sys.argv[1:] == ["-f"]:  # ignores quit and SIGTERM; runs a server of its own, as the real daemon does
    import signal
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    open(os.path.join(pipe, "control"), "w").close()
    while True:
        time.sleep(0.05)
else:
    sys.stdin.read()
"""


def test_a_daemon_that_ignores_quit_is_killed_with_its_servers(standin, host_store, fleet_home, monkeypatch) -> None:
    path = standin.bin / "nvidia-cuda-mps-control"
    path.write_text(DEAF_DAEMON.format(python=sys.executable))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setattr("collector.mps.QUIT_WAIT_S", 0.3)
    pipe = fleet_home / "mps" / "pipe"
    sup = _supervisor(host_store)
    sup.check({4: 0.3})
    assert wait_for(lambda: len(_daemons_of(pipe)) == 2, timeout=10)  # the daemon and its server
    sup.check({})
    assert not _daemons_of(pipe) and not (pipe / "control").exists()


def test_an_agent_stopping_under_busy_lanes_kills_a_deaf_daemon_but_not_the_servers_its_jobs_run_on(
        standin, host_store, fleet_home, monkeypatch) -> None:
    path = standin.bin / "nvidia-cuda-mps-control"
    path.write_text(DEAF_DAEMON.format(python=sys.executable))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setattr("collector.mps.QUIT_WAIT_S", 0.3)
    pipe = fleet_home / "mps" / "pipe"
    sup = _supervisor(host_store)
    sup.check({4: 0.3})  # a lane's job runs on the daemon's server, and goes on after the agent
    daemon = sup.proc.pid
    (server,) = wait_for(lambda: [p for p in _daemons_of(pipe) if p.pid != daemon], timeout=10)
    sup.close()
    try:
        assert [p.pid for p in _daemons_of(pipe)] == [server.pid]
    finally:
        server.kill()
        server.wait(timeout=10)


def test_a_missing_binary_is_said_once_and_lanes_go_on_without_mps(standin, host_store, caplog) -> None:
    sup = _supervisor(host_store)  # nothing installed on PATH yet
    sup.check({5: 0.5})
    sup.check({5: 0.5})
    assert sup.state == "unavailable" and sup.proc is None
    errors = [m for level, m in _host_events(host_store) if level == "error"]
    assert len(errors) == 1
    assert errors[0].startswith("nvidia-cuda-mps-control is not on PATH: lanes on this host run without MPS")
    assert "FLEETLENS_MPS=false" in errors[0]
    assert "not on PATH" in caplog.text
    standin.install()  # the tools arrive: the next round starts the daemon
    sup.check({5: 0.5})
    assert sup.state == "running" and len(standin.events("daemon")) == 1
    sup.close()


def test_a_share_smaller_than_mps_can_express_is_clamped_and_said(standin, host_store) -> None:
    standin.install()
    assert thread_percentage(0.004) == (1, True) and thread_percentage(0.37) == (37, False)
    assert thread_percentage(1.0) == (100, False)
    sup = _supervisor(host_store)
    sup.check({6: 0.004, 7: 0.6})
    sup.check({6: 0.004, 7: 0.6})
    assert sup.percentages == {6: 1, 7: 60}
    assert standin.commands() == ["set_default_active_thread_percentage 60"]
    warnings = [m for level, m in _host_events(host_store) if level == "warning"]
    assert warnings == ["lane 6's compute share 0.40% is outside what MPS can express (1-100 % of the SMs); its "
                        "jobs get 1 %"]
    sup.close()


def _gpu_lane(store: Store, share: float, *, device_index: int = 7, source: str = "nvml") -> tuple[int, int, str]:
    """A device of HOST, an open lane on it with `share`, and an active placement in it: (device, lane, workflow)."""
    now = time.time()
    with store.session() as session:
        (device_id,) = register_devices(session, HOST, [DeviceSpec(device_index, f"GPU-mps-{device_index}", "gpu",
                                                                   16 << 30)], source=source).values()
        wf = f"wf-lane-{device_index}"
        upsert_workflow(session, wf)
        lane = Lane(device_id=device_id, size_bytes=8 << 30, compute_share=share, created_at=now)
        session.add(lane)
        session.flush()
        session.add(Placement(workflow_id=wf, device_id=device_id, lane_id=lane.id, host_id=HOST, started_at=now,
                              compute_share=share))
        return device_id, lane.id, wf


def test_each_lanes_job_gets_its_percentage_and_the_daemons_pipe(host_store, fleet_home) -> None:
    device_id, lane_id, wf = _gpu_lane(host_store, 0.004)
    settings = Settings(mps=True)
    with host_store.session() as session:
        env, cores = job_env(session, wf, [device_id], lane_id, host_id=HOST, mps_dirs=settings.mps_dirs)
        plain, _ = job_env(session, wf, [device_id], lane_id, host_id=HOST, mps_dirs=Settings().mps_dirs)
        assert busy_gpu_lanes(session, HOST) == {lane_id: 0.004}
    assert cores is None and env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "1"  # clamped like the daemon's
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(fleet_home / "mps" / "pipe")
    assert env["CUDA_MPS_LOG_DIRECTORY"] == str(fleet_home / "mps" / "log")
    assert "CUDA_MPS_PIPE_DIRECTORY" not in plain  # a fleet without MPS points its jobs at no daemon


def test_only_gpu_lanes_holding_a_job_need_mps(host_store) -> None:
    _, cpu_lane, _ = _gpu_lane(host_store, 0.5, device_index=8, source="cpu")
    _, gpu_lane, wf = _gpu_lane(host_store, 0.5, device_index=9)
    with host_store.session() as session:
        assert busy_gpu_lanes(session, HOST) == {gpu_lane: 0.5}
        session.execute(update(Placement).where(Placement.workflow_id == wf).values(state="ended"))
        assert busy_gpu_lanes(session, HOST) == {}
    assert cpu_lane != gpu_lane


def test_the_agent_runs_the_daemon_while_a_lane_on_its_gpus_holds_a_job(standin, host_store, fleet_home,
                                                                         monkeypatch) -> None:
    standin.install()
    monkeypatch.setenv("FLEETLENS_MPS", "true")
    monkeypatch.setenv("FLEETLENS_MPS_CHECK_INTERVAL_S", "0.1")
    settings = Settings()
    _, lane_id, wf = _gpu_lane(host_store, 0.4)
    agent = Agent(host_store, settings, StubSource(n=1), host_id=HOST, sample_interval_s=0.05,
                  flush_interval_s=0.3, serve_socket=False, attribute=lambda pid: ("wf-agent", "env"))
    try:
        agent.start()
        wait_for(lambda: standin.commands() == ["set_default_active_thread_percentage 40"], timeout=60)
        assert agent.mps is not None and agent.mps.percentages == {lane_id: 40}
        with host_store.session() as session:  # the job ends: its lane needs MPS no more
            session.execute(update(Placement).where(Placement.workflow_id == wf).values(state="ended"))
        wait_for(lambda: "quit" in standin.commands(), timeout=60)
        wait_for(lambda: agent.mps.proc is None, timeout=60)
        with host_store.session() as session:  # the lane is busy again, then the agent stops: the daemon goes
            session.execute(update(Placement).where(Placement.workflow_id == wf).values(state="active"))
        wait_for(lambda: len(standin.events("daemon")) == 2, timeout=60)
    finally:
        agent.stop()
    assert standin.commands().count("quit") == 2
    assert not _daemons_of(fleet_home / "mps" / "pipe")
    messages = [m for _, m in _host_events(host_store)]
    assert messages[-1] == "MPS control daemon stopped: the agent is stopping"


def test_an_agent_without_the_binary_says_so_and_keeps_sampling(standin, host_store, monkeypatch) -> None:
    monkeypatch.setenv("FLEETLENS_MPS", "true")
    monkeypatch.setenv("FLEETLENS_MPS_CHECK_INTERVAL_S", "0.1")
    _gpu_lane(host_store, 0.5)
    agent = Agent(host_store, Settings(), StubSource(n=1), host_id=HOST, sample_interval_s=0.05,
                  flush_interval_s=0.2, serve_socket=False, attribute=lambda pid: ("wf-agent", "env"))
    try:
        agent.start()
        wait_for(lambda: any("not on PATH" in m for _, m in _host_events(host_store)), timeout=60)
        rounds = agent.stats.rounds
        wait_for(lambda: agent.stats.batches_written >= 2 and agent.stats.rounds > rounds + 3, timeout=60)
        assert agent.mps.state == "unavailable" and standin.events() == []
    finally:
        agent.stop()
    assert [level for level, m in _host_events(host_store) if "not on PATH" in m] == ["error"]  # said once
