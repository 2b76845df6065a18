"""A copy of a managed job left running on a host the store no longer places it on is stopped by that host's agent
when it is heard from again (collector.job_fence), and nothing else is.

The move is driven through the real state machine on a fake clock (tests.enforcer.silent_fleet): the target's agent
claims the relaunch and is cut off from the database before it answers, so the move puts the job back on its source.
The copy the target started meanwhile is a real process carrying the environment the agent gives a managed job; the
target's real agent (collector.agent.Agent, one round) then finds the database again."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from sqlalchemy import select

from collector.agent import Agent
from collector.job_reaper import REAPER, ReaperHost
from enforcer.migration import drive
from store.db import Store
from store.models import HostEvent
from tests.collector.agent_helpers import StubSource
from tests.enforcer.silent_fleet import DST, JOB, SETTINGS, SRC, T0, SilentFleet


class Copies:
    """Processes standing for jobs' copies, ended when the test is."""

    def __init__(self, home: Path) -> None:
        self.home, self.procs = home, []

    def start(self, workflow: str | None, managed_by: str | None) -> subprocess.Popen:
        env = {**os.environ, "FLEETLENS_HOME": str(self.home)}
        env.pop("FLEETLENS_WORKFLOW", None)
        env.pop("FLEETLENS_MANAGED", None)
        if workflow is not None:
            env["FLEETLENS_WORKFLOW"] = workflow
        if managed_by is not None:
            env["FLEETLENS_MANAGED"] = managed_by
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], env=env,
                                start_new_session=True)  # detached, as the agent starts a job
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


@pytest.fixture
def copies(tmp_path: Path) -> Iterator[Copies]:
    c = Copies(tmp_path)
    yield c
    c.stop()


def running(proc: subprocess.Popen) -> bool:
    try:
        return psutil.Process(proc.pid).status() != psutil.STATUS_ZOMBIE and proc.poll() is None
    except psutil.NoSuchProcess:
        return False


def heard_again(store: Store, host: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Agent:
    """`host`'s real agent finds the database again: one round (register, sample, write, commands). Its reaper
    records job endings in this store, as the running agent's does."""
    settings = SETTINGS.model_copy(update={"home": tmp_path / f"home-{host}"})
    monkeypatch.setattr(REAPER, "host", ReaperHost(store, settings, None, None, lambda: None))
    agent = Agent(store, settings, StubSource(n=1), host_id=host, serve_socket=False)
    agent.run_once()
    return agent


def silent_after_claiming_the_relaunch(store: Store, tmp_path: Path) -> SilentFleet:
    """The job is stopped on its source at T0 + 9 and the relaunch claimed by the target at T0 + 11, which then falls
    silent (cut off from the database, not dead) and never answers it."""
    f = SilentFleet(store, tmp_path, silent_at={SRC: None, DST: T0 + 11.5}).seed()
    f.begin()
    return f


def test_a_copy_started_by_a_relaunch_never_reported_is_stopped_when_its_agent_is_heard_from_again(
        any_store: Store, tmp_path: Path, copies: Copies, monkeypatch: pytest.MonkeyPatch) -> None:
    f = silent_after_claiming_the_relaunch(any_store, tmp_path)
    state, _ = f.run(until=900)
    assert state == "rolled_back", f.log()
    assert (f.placement_host(), f.workflow_state()) == (SRC, "running")  # the store runs it on the source again
    assert [c for c in f.commands() if c[0] == "relaunch"][0] == ("relaunch", DST, "running")  # claimed, unanswered
    stale = copies.start(JOB, DST)  # what the target started on the relaunch it claimed
    REAPER.add(stale, JOB)  # as the agent that started it watches it
    other_job = copies.start("someone-else", DST)  # a managed job of another workflow, placed nowhere
    unmanaged = copies.start(JOB, None)  # a process fleetlens did not start, though it names the workflow
    other_host = copies.start(JOB, "elsewhere")  # another host's copy
    agent = heard_again(any_store, DST, tmp_path, monkeypatch)

    assert not running(stale), "the copy at the target still runs beside the one on the source: two copies"
    assert all(running(p) for p in (other_job, unmanaged, other_host))
    assert [d["workflow_id"] for d in agent.stats.fenced] == [JOB]
    # its end is not the job's: the job runs on at the source
    REAPER.reap()
    assert (f.placement_host(), f.workflow_state()) == (SRC, "running")
    with any_store.session() as s:
        events = [(e.host_id, e.kind, e.message) for e in s.scalars(select(HostEvent).where(HostEvent.kind == "fence"))]
    assert len(events) == 1 and events[0][:2] == (DST, "fence") and f"on {SRC}" in events[0][2]
    assert f"stopped {JOB} (pids [{stale.pid}], without a checkpoint) on {DST}" in f.log()


def test_a_copy_is_left_alone_while_its_move_is_under_way_and_on_the_host_the_store_places_it(
        any_store: Store, tmp_path: Path, copies: Copies, monkeypatch: pytest.MonkeyPatch) -> None:
    f = silent_after_claiming_the_relaunch(any_store, tmp_path)
    now = T0
    while now < T0 + 13:  # the relaunch is claimed and not yet overdue: the move may still record it
        f.tick(now)
        drive(any_store, f.action_id, settings=SETTINGS, now=now)
        now += 1.0
    assert f.commands()[-1] == ("relaunch", DST, "running")
    at_target = copies.start(JOB, DST)
    heard_again(any_store, DST, tmp_path, monkeypatch)
    assert running(at_target)  # the move under way started it there, as far as the agent can tell

    state, _ = f.run(until=900, since=now - T0)  # the move goes on and puts the job back on its source
    assert state == "rolled_back", f.log()
    at_source = copies.start(JOB, SRC)
    heard_again(any_store, SRC, tmp_path, monkeypatch)
    assert running(at_source)  # the copy where the store places it
    heard_again(any_store, DST, tmp_path, monkeypatch)
    assert not running(at_target) and running(at_source)
