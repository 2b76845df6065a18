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

from collector import command_runner
from collector.agent import Agent
from collector.job_reaper import REAPER, ReaperHost
from enforcer.migration import drive
from enforcer.migration_steps import MigrationOptions
from store.commands import enqueue_command, finish
from store.db import Store
from store.errors import DatabaseUnavailable
from store.models import Command, HostEvent
from store.settings import Settings
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


def silent_after_claiming_the_relaunch(store: Store, tmp_path: Path, settings: Settings = SETTINGS) -> SilentFleet:
    """The job is stopped on its source at T0 + 9 and the relaunch claimed by the target at T0 + 11, which then falls
    silent (cut off from the database, not dead) and never answers it."""
    f = SilentFleet(store, tmp_path, silent_at={SRC: None, DST: T0 + 11.5}, settings=settings).seed()
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


def test_a_start_the_database_never_took_is_stopped_by_its_agent_when_its_relaunch_expires(
        any_store: Store, tmp_path: Path, copies: Copies, monkeypatch: pytest.MonkeyPatch) -> None:
    """The lease the roll back relies on: cut off from the database, the target's agent stops the job it started for
    a move once the relaunch has expired, since the move then takes it for lost (and may put the job back)."""
    f = SilentFleet(any_store, tmp_path).seed()
    f.begin()
    settings = SETTINGS.model_copy(update={"home": tmp_path / "home-dst"})
    agent = Agent(any_store, settings, StubSource(n=1), host_id=DST, serve_socket=False)
    with any_store.session() as s:
        command_id = enqueue_command(s, DST, "relaunch", {"workflow_id": JOB, "device_id": f.devices[DST],
                                                          "purpose": "move", "deadline_s": 8.0}, ttl=23.0,
                                     action_id=f.action_id, secret=SETTINGS.secret_bytes()).id
    cut_off = {"now": False}
    session = any_store.session

    def through_the_cut(*args, **kwargs):
        if cut_off["now"]:
            raise DatabaseUnavailable("cut off from the database")
        return session(*args, **kwargs)

    started: list[subprocess.Popen] = []

    def relaunch(payload, ctx):  # starts the job, then the database goes away before the outcome is written
        started.append(copies.start(JOB, DST))
        cut_off["now"] = True
        return {"pid": started[0].pid, "log": "job.log"}

    monkeypatch.setattr(any_store, "session", through_the_cut)
    monkeypatch.setitem(command_runner._HANDLERS, "relaunch", relaunch)
    assert agent.poll_commands() == []  # the outcome could not be written
    with session() as s:
        expires_at = s.get(Command, command_id).expires_at
    assert agent.fencer.lapsed(agent.runner, now=expires_at - 1) == []
    assert running(started[0])  # the move may still hear of it
    done = agent.fencer.lapsed(agent.runner, now=expires_at + 1)
    assert [d["stopped"] for d in done] == [[started[0].pid]]
    assert not running(started[0])

    cut_off["now"] = False  # the database is back: the relaunch's outcome says what happened, and so does the host
    monkeypatch.setattr(agent, "_db_up", True)
    agent.poll_commands()
    with session() as s:
        command = s.get(Command, command_id)
        assert command.status == "failed" and command.result["fenced"] and "puts the job back" in \
            command.result["error"]
        assert [e.kind for e in s.scalars(select(HostEvent).where(HostEvent.host_id == DST))] == ["fence"]
    assert "could not be reported before the relaunch expired" in f.log()


def test_the_roll_back_waits_for_the_fence_of_a_relaunch_claimed_and_never_answered(
        any_store: Store, tmp_path: Path) -> None:
    # the target counts as silent 20 s after it claimed the relaunch, before that relaunch's deadline (T0 + 33): the
    # move puts the job back as soon as the deadline has passed
    f = silent_after_claiming_the_relaunch(
        any_store, tmp_path, SETTINGS.model_copy(update={"host_silent_after_s": 20.0}))
    state, _ = f.run(until=900)
    assert state == "rolled_back", f.log()
    options = MigrationOptions.from_settings(SETTINGS)
    with any_store.session() as s:
        sent = list(s.scalars(select(Command).where(Command.action_id == f.action_id, Command.kind == "relaunch")
                              .order_by(Command.id)))
        claimed = [c for c in sent if c.host_id == DST and c.status == "running"]
        back = [c for c in sent if c.host_id == SRC]
        assert claimed and back
        # the source starts the job only after the target's agent has stopped what it may have started
        fenced_by = max(c.expires_at for c in claimed) + options.stop_grace_s + 5
        assert back[0].issued_at > fenced_by
    assert "was claimed and never answered: waiting until" in f.log()
    assert (f.placement_host(), f.workflow_state()) == (SRC, "running")


def test_a_relaunch_answered_after_the_move_gave_up_on_it_is_stopped_before_the_job_starts_where_it_was(
        any_store: Store, tmp_path: Path) -> None:
    # as above, and the target's agent, its clock behind the enforcer's, answers the relaunch 12 s after the move
    # took it for lost: the job runs there, unknown to the move
    f = silent_after_claiming_the_relaunch(
        any_store, tmp_path, SETTINGS.model_copy(update={"host_silent_after_s": 20.0}))
    now = T0
    while now < T0 + 45:
        f.tick(now)
        drive(any_store, f.action_id, settings=f.settings, now=now)
        now += 1.0
    with any_store.session() as s:
        claimed = s.scalar(select(Command).where(Command.action_id == f.action_id, Command.kind == "relaunch",
                                                 Command.host_id == DST))
        finish(s, claimed.id, "done", {"pid": 555, "log": "job.log"}, now=now)
    f.silent_at[DST] = None  # heard from again
    f.running_on, f.copies = DST, f.copies + 1
    f.most_copies = max(f.most_copies, f.copies)
    state, _ = f.run(until=900, since=now - T0)
    assert state == "rolled_back", f.log()
    assert f.most_copies == 1  # never at both ends
    assert ("stop", DST, "done") in f.commands() and "after the move had given up on that relaunch" in f.log()
    assert (f.running_on, f.placement_host(), f.workflow_state()) == (SRC, SRC, "running")
