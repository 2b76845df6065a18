"""The per-host agent: samples into the store, registers host/devices/workflows, marks lost devices,
runs commands addressed to it, serves the SDK socket, and flushes on a clean stop."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import time
from dataclasses import replace
from pathlib import Path

import pytest
from sqlalchemy import select

import collector.agent as agent_module
import collector.agent_procs as agent_procs
from collector.agent import Agent
from collector.socket_server import connect
from collector.sources.base import DeviceInfo, ProcessReading
from enforcer.fleet_state import read_fleet_state
from store.commands import enqueue_command, get_command
from store.db import Store
from store.migrations import upgrade
from store.models import Device, DeviceSample, Host, Process, ProcessSample, Workflow
from store.settings import Settings
from tests.collector.agent_helpers import StubSource, count_samples, wait_for


def fixed_attribution(pid: int) -> tuple[str, str]:
    return ("wf-agent-test", "env")


@pytest.fixture
def settings(fleet_home: Path) -> Settings:
    return Settings()


def make_agent(store, settings, source, **kw) -> Agent:
    kw.setdefault("sample_interval_s", 0.05)
    kw.setdefault("flush_interval_s", 0.3)
    kw.setdefault("attribute", fixed_attribution)
    kw.setdefault("serve_socket", False)
    return Agent(store, settings, source, host_id=kw.pop("host_id", "host-a"), **kw)


def test_agent_writes_every_sample_it_takes(any_store, settings):
    source = StubSource(n=3)
    agent = make_agent(any_store, settings, source).start()
    wait_for(lambda: agent.stats.batches_written >= 3)
    agent.stop()
    assert source.closed
    assert agent.stats.rounds > 5
    assert count_samples(any_store) == (agent.stats.device_rows, agent.stats.process_rows)
    assert agent.stats.device_rows == 3 * agent.stats.rounds
    with any_store.session() as s:
        host = s.get(Host, "host-a")
        assert host.source == "cpu" and host.last_seen > time.time() - 10
        assert sorted(d.index for d in s.scalars(select(Device).where(Device.host_id == "host-a"))) == [0, 1, 2]
        assert s.get(Workflow, "wf-agent-test").id_source == "env"
        procs = s.scalars(select(Process)).all()
        assert [(p.pid, p.workflow_id) for p in procs] == [(source.pids[0], "wf-agent-test")]
        assert procs[0].ended_at is None
    assert len(agent.spool) == 0


def test_a_device_lost_under_a_lane_is_reported_per_job_and_nothing_is_dropped(any_store, settings):
    from enforcer.managed import load_host_fleet
    from store.models import Action, ActionEvent, Lane, Placement
    from store.registry import DEVICE_LOST
    from store.workflows import upsert_workflow
    from ui.dashboard import queries

    source = StubSource(n=2)
    agent = make_agent(any_store, settings, source).start()
    try:
        wait_for(lambda: agent.stats.batches_written >= 1)
        with any_store.session() as s:
            dev = {d.index: d.id for d in s.scalars(select(Device).where(Device.host_id == "host-a"))}
            lane = Lane(device_id=dev[1], size_bytes=1 << 30, compute_share=0.5, state="open", created_at=1.0)
            s.add(lane)
            s.flush()
            lane_id = lane.id
            for name, device, in_lane in (("mate-a", dev[1], True), ("mate-b", dev[1], True), ("elsewhere", dev[0],
                                                                                                False)):
                upsert_workflow(s, name, managed=True, id_source="managed", state="running")
                s.add(Placement(workflow_id=name, device_id=device, lane_id=lane_id if in_lane else None,
                                host_id="host-a", pid=100, mem_persistent=1 << 20, mem_ephemeral=0, state="active",
                                started_at=1.0))
        source.lost.add(1)
        wait_for(lambda: len(queries.actions(any_store)) == 2, timeout=20)
        rounds = agent.stats.rounds
        wait_for(lambda: agent.stats.rounds > rounds + 5)  # it keeps sampling, and reports the loss only once
    finally:
        agent.stop()
    shown = queries.actions(any_store)  # what the dashboard's enforcement page lists
    assert sorted(shown["workflow_id"]) == ["mate-a", "mate-b"] and set(shown["kind"]) == {DEVICE_LOST}
    for error in shown["error"]:
        assert "device 1 (stub device, stub-" in error and "fell off the bus" in error and f"lane {lane_id}" in error
    with any_store.session() as s:
        assert s.get(Device, dev[1]).state == "lost"
        events = list(s.scalars(select(ActionEvent)))
        assert len(events) == 2 and all(e.to_state == "failed" and e.detail["lane_id"] == lane_id for e in events)
        assert {a.state for a in s.scalars(select(Action))} == {"failed"}
        # nothing lost: every placement, the lane and the workflows are as they were
        assert [p.state for p in s.scalars(select(Placement))] == ["active"] * 3
        assert s.get(Lane, lane_id).state == "open"
        assert {w.state for w in s.scalars(select(Workflow).where(Workflow.id.in_(["mate-a", "mate-b"])))} == {
            "running"}
        fleet, devices = load_host_fleet(s, "host-a", settings)
        assert list(devices) == [dev[0]]  # no new job goes onto the lost device


def test_lost_device_is_marked_and_the_agent_carries_on(sqlite_store, settings):
    source = StubSource(n=2)
    agent = make_agent(sqlite_store, settings, source).start()
    wait_for(lambda: agent.stats.batches_written >= 1)
    source.lost.add(1)
    rounds = agent.stats.rounds

    def lost_state():
        with sqlite_store.session() as s:
            return s.scalar(select(Device.state).where(Device.host_id == "host-a", Device.index == 1)) == "lost"

    wait_for(lost_state)
    wait_for(lambda: agent.stats.rounds > rounds + 5)
    source.lost.clear()  # it came back (reset): registered as ok again

    def ok_state():
        with sqlite_store.session() as s:
            return s.scalar(select(Device.state).where(Device.host_id == "host-a", Device.index == 1)) == "ok"

    wait_for(ok_state)
    agent.stop()
    assert count_samples(sqlite_store)[0] == agent.stats.device_rows  # device 0 kept being written throughout


def test_a_device_lost_while_the_database_is_away_and_the_spool_disk_full_is_still_marked(tmp_path, settings,
                                                                                           monkeypatch):
    folder = tmp_path / "db"
    folder.mkdir()
    store = Store(f"sqlite:///{folder / 'fleetlens.db'}")
    upgrade(store)
    source = StubSource(n=2)
    agent = make_agent(store, settings, source)
    agent.sample_once()
    assert agent.flush()
    store.dispose()
    folder.rename(tmp_path / "away")  # the database goes away...
    source.lost.add(1)
    agent.sample_once()

    def disk_full(fd: int, data) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", disk_full)  # ...and the spool's disk is full
    assert agent.flush() is False  # the batch is dropped and counted, the flush goes on
    monkeypatch.undo()
    assert agent.spool.dropped_rows == 2 and agent.stats.batches_spooled == 0  # device 0's row and its process's
    (tmp_path / "away").rename(folder)
    agent.sample_once()
    assert agent.flush()
    with store.session() as s:
        assert s.scalar(select(Device.state).where(Device.host_id == "host-a", Device.index == 1)) == "lost"
    store.dispose()


def test_a_device_lost_in_a_batch_the_database_refused_is_still_marked(sqlite_store, settings, monkeypatch):
    source = StubSource(n=2)
    agent = make_agent(sqlite_store, settings, source)
    agent.sample_once()
    assert agent.flush()
    source.lost.add(1)
    agent.sample_once()
    written = agent_module.write_samples
    refusals = []

    def refuse_once(*args, **kwargs):
        if not refusals:
            refusals.append(1)
            raise ValueError("a row the database refuses")  # not an outage: the batch goes to the spool
        return written(*args, **kwargs)

    monkeypatch.setattr(agent_module, "write_samples", refuse_once)
    with pytest.raises(ValueError):
        agent.flush()
    agent.sample_once()
    assert agent.flush()
    with sqlite_store.session() as s:
        assert s.scalar(select(Device.state).where(Device.host_id == "host-a", Device.index == 1)) == "lost"
    assert count_samples(sqlite_store)[0] == agent.stats.device_rows  # the refused batch went at the next flush


def test_a_pid_taken_by_another_process_is_attributed_again_at_once(sqlite_store, settings, monkeypatch):
    now = {"start": 1000.0, "workflow": "first"}  # the process under pid 4242 as /proc says it

    class Proc:  # psutil.Process as the agent reads it
        def __init__(self, pid: int) -> None:
            self.pid = pid

        def oneshot(self):
            return contextlib.nullcontext()

        def create_time(self) -> float:
            return now["start"]

        def cmdline(self) -> list[str]:
            return [now["workflow"]]

        def username(self) -> str:
            return "someone"

    class Source(StubSource):  # reports the start time of each process, as the cpu source does
        def sample(self):
            readings = super().sample()
            for r in readings:
                r.processes = [ProcessReading(pid=4242, cpu_util=0.5, start_time=now["start"])]
            return readings

    monkeypatch.setattr(agent_procs.psutil, "Process", Proc)
    agent = make_agent(sqlite_store, settings, Source(n=1), attribute=lambda pid: (now["workflow"], "env"))
    agent.sample_once()
    now.update(start=1001.0, workflow="second")  # the first ended; a new process got its pid within the second
    agent.sample_once()
    agent.flush()
    with sqlite_store.session() as s:
        samples = s.scalars(select(ProcessSample).order_by(ProcessSample.ts)).all()
        assert [p.workflow_id for p in samples] == ["first", "second"]
        assert sorted((p.pid, p.workflow_id) for p in s.scalars(select(Process))) == [(4242, "second")]


def test_a_device_the_source_opens_later_keeps_its_first_rows(sqlite_store, settings):
    source = StubSource(n=1)
    agent = make_agent(sqlite_store, settings, source)
    agent.sample_once()
    assert agent.flush()
    source.n = 2  # a MIG instance made: the source lists a device the agent did not register at its start
    agent.sample_once()
    assert agent.flush()
    assert agent.stats.rows_dropped == 0
    assert count_samples(sqlite_store) == (agent.stats.device_rows, agent.stats.process_rows) == (3, 3)
    with sqlite_store.session() as s:
        assert sorted(d.index for d in s.scalars(select(Device).where(Device.host_id == "host-a"))) == [0, 1]


def test_a_device_made_again_at_its_index_is_registered_before_its_rows_are_written(any_store, settings,
                                                                                     monkeypatch):
    """A MIG instance destroyed and another made at the same MIG index (a new UUID, maybe another profile): its
    rows went to the registered device as it was, whose UUID and memory the agent never changed."""
    source = StubSource(n=1)
    agent = make_agent(any_store, settings, source)
    agent.sample_once()
    assert agent.flush()
    remade = DeviceInfo(0, f"MIG-{source.tag}-again", "A100 3g.40gb", 40 << 30)
    monkeypatch.setattr(source, "devices", lambda: [remade])
    agent.sample_once()
    assert agent.flush()
    with any_store.session() as s:
        (device,) = s.scalars(select(Device).where(Device.host_id == "host-a"))
        assert (device.uuid, device.memory_total) == (remade.uuid, 40 << 30)
        latest = s.scalar(select(DeviceSample.device_id).order_by(DeviceSample.ts.desc()).limit(1))
    assert latest == device.id and agent.stats.rows_dropped == 0


class ListedSource(StubSource):
    """A GPU whose MIG mode changes: the source lists the device indexes in `listed` (MIG devices from 1000 on)."""

    def __init__(self, listed: list[int]) -> None:
        super().__init__(n=0)
        self.listed = listed

    def devices(self):
        return [DeviceInfo(i, f"stub-{self.tag}-{i}", "stub device", 1 << 30) for i in self.listed]

    def sample(self):
        self.n = len(self.listed)
        return [replace(r, index=i) for r, i in zip(super().sample(), self.listed, strict=True)]


def test_a_device_the_source_no_longer_lists_takes_no_jobs(any_store, settings):
    def usable() -> dict[int, str]:
        with any_store.session() as s:
            placeable = {d.index for d in read_fleet_state(s).devices.values()}
            states = {d.index: d.state for d in s.scalars(select(Device).where(Device.host_id == "host-a"))}
        assert placeable == {i for i, state in states.items() if state == "ok"}
        return states

    source = ListedSource([0])
    agent = make_agent(any_store, settings, source)
    agent.sample_once()
    assert agent.flush()
    source.listed = [1000, 1001]  # MIG turned on: the GPU is two MIG devices now, its memory theirs
    agent.sample_once()
    assert agent.flush()
    assert usable() == {0: "gone", 1000: "ok", 1001: "ok"}
    source.listed = [0]  # and off again
    agent.sample_once()
    assert agent.flush()
    assert usable() == {0: "ok", 1000: "gone", 1001: "gone"}
    assert agent.stats.rows_dropped == 0
    # an agent started after a change retires what its source no longer lists as it registers
    again = make_agent(any_store, settings, ListedSource([1000]))
    again.sample_once()
    assert again.flush()
    assert usable() == {0: "gone", 1000: "ok", 1001: "gone"}


def test_vanished_processes_are_skipped(sqlite_store, settings):
    source = StubSource(n=1, pids=[2**22 + 12345])  # above pid_max's default: no such process
    agent = make_agent(sqlite_store, settings, source, attribute=None)  # would need collector.attribution
    agent.sample_once()
    agent.flush()
    assert count_samples(sqlite_store) == (1, 0)


def test_commands_addressed_to_the_host_are_run(sqlite_store, settings):
    agent = make_agent(sqlite_store, settings, StubSource(n=1), command_interval_s=0.1).start()
    try:
        with sqlite_store.session() as s:
            mine = enqueue_command(s, "host-a", "ping", {"echo": 1}, 60, secret=settings.secret_bytes()).id
            other = enqueue_command(s, "host-b", "ping", {"echo": 2}, 60, secret=settings.secret_bytes()).id
        wait_for(lambda: any(o.command_id == mine for o in agent.stats.commands))
    finally:
        agent.stop()
    with sqlite_store.session() as s:
        assert get_command(s, mine).status == "done" and get_command(s, mine).result["echo"] == 1
        assert get_command(s, other).status == "pending"


def test_stop_flushes_what_is_buffered(sqlite_store, settings):
    agent = make_agent(sqlite_store, settings, StubSource(n=2), flush_interval_s=3600).start()
    wait_for(lambda: agent.stats.rounds >= 3)
    agent.stop()
    assert agent.stats.batches_written == 1
    assert count_samples(sqlite_store)[0] == agent.stats.device_rows > 0


def test_serves_the_sdk_socket_while_running(sqlite_store, settings):
    agent = make_agent(sqlite_store, settings, StubSource(n=1), serve_socket=True).start()
    try:
        with connect(settings.socket_path, timeout=5) as sock:
            sock.sendall(json.dumps({"op": "poll", "v": 1, "workflow": "wf", "pid": 1}).encode() + b"\n")
            reply = json.loads(sock.makefile("rb").readline())
        assert isinstance(reply, dict) and "ok" in reply
    finally:
        agent.stop()
    assert not settings.socket_path.exists()


def test_bad_intervals_are_refused(sqlite_store, settings):
    with pytest.raises(ValueError, match="positive"):
        Agent(sqlite_store, settings, StubSource(), sample_interval_s=-1)


def test_cli_refuses_bad_intervals(fleet_home, capsys):
    from ui.cli import run

    assert run(["agent", "--interval", "0"]) == 2
    assert "--interval must be a positive number of seconds" in capsys.readouterr().err
    assert run(["agent", "--flush-interval", "-3", "--once"]) == 2
    for option, bad in (("--interval", "nan"), ("--flush-interval", "inf"), ("--duration", "nan")):
        assert run(["agent", option, bad, "--once"]) == 2
        assert f"{option} must be a positive number of seconds" in capsys.readouterr().err


def test_cli_refuses_a_database_without_schema(fleet_home, capsys):
    from ui.cli import run

    fleet_home.mkdir(parents=True, exist_ok=True)
    assert run(["agent", "--once"]) == 2
    assert "fleetlens init" in capsys.readouterr().err


def test_cli_once_records_this_machine(fleet_home, capsys):
    from ui.cli import run

    assert run(["init"]) == 0
    assert run(["agent", "--once", "--source", "cpu", "--host-id", "cli-host"]) == 0
    assert "cli-host" in capsys.readouterr().out
    store = Store.from_settings(Settings())
    with store.session() as s:
        devices = s.scalars(select(Device).where(Device.host_id == "cli-host")).all()
        assert devices and all(d.source == "cpu" for d in devices)
    assert count_samples(store, "cli-host")[0] == len(devices)


def test_the_storage_prober_and_the_reaper_stop_with_the_agent(sqlite_store, fleet_home, tmp_path):
    """The prober says which checkpoint locations the host can read while the agent runs; once the agent has
    stopped, its thread is gone and no probe is written (the store may be gone by then). The job reaper's thread
    ends with the last agent of the process too."""
    import threading

    from store.models import HostStorage

    shared = tmp_path / "shared-checkpoints"
    shared.mkdir()
    settings = Settings(checkpoint_url=str(shared), storage_probe_s=0.05)
    agent = make_agent(sqlite_store, settings, StubSource(n=1)).start()

    def probes() -> list[tuple[str, bool, float]]:
        with sqlite_store.session() as s:
            return [(r.url, r.readable, r.checked_at) for r in s.scalars(select(HostStorage))]

    seen: set[float] = set()

    def probed_again() -> bool:
        seen.update(checked for _, _, checked in probes())
        return len(seen) >= 3

    try:
        wait_for(probed_again)  # it probes again and again
        assert probes()[0][:2] == (str(shared), True)
        assert any(t.name == "fleetlens-storage-probe" for t in threading.enumerate())
        assert any(t.name == "fleetlens-reaper" for t in threading.enumerate())
    finally:
        agent.stop()
    assert not any(t.name in ("fleetlens-storage-probe", "fleetlens-reaper") for t in threading.enumerate())
    with sqlite_store.session() as s:
        s.query(HostStorage).delete()
    time.sleep(20 * settings.storage_probe_s)  # twenty rounds' time: a prober still running would have written
    assert probes() == []


def test_the_reaper_runs_on_while_another_agent_of_the_process_runs(sqlite_store, fleet_home, tmp_path):
    """Several agents in one process (benchmarks/agents_load.py's virtual hosts) share the job reaper: one agent's
    stop leaves it reaping for the others, and the last one's stop ends it."""
    import threading

    def reaper_alive() -> bool:
        return any(t.name == "fleetlens-reaper" and t.is_alive() for t in threading.enumerate())

    settings = Settings(storage_probe_s=3600)
    first = make_agent(sqlite_store, settings, StubSource(n=1), host_id="first").start()
    second = make_agent(sqlite_store, settings, StubSource(n=1), host_id="second").start()
    try:
        first.stop()
        assert reaper_alive(), "the reaper stopped while an agent of the process still runs"
    finally:
        second.stop()
    assert not reaper_alive()
