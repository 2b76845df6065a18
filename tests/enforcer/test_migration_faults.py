"""Fault injection on real migrations (real agent, real torch jobs): the job killed during its checkpoint, the agent
killed during relaunch, the target lane full at relaunch, the job dying at the target before its first step, the
database unreachable mid-move. Each time the job ends up running somewhere with progress at or past its last
checkpoint, and the action log says what happened."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import select

from enforcer.actuators.drive import drive_actions
from enforcer.migration import MigrationOptions, MoveRefused, action_log, drive, start_migration
from store.db import Store
from store.migrations import upgrade
from store.models import Action, Command, Lane, Placement
from store.settings import get_settings
from tests.collector.agent_helpers import TcpProxy, wait_for
from tests.enforcer.migration_helpers import (  # noqa: F401  (rig_fixture: the `rig` fixture)
    FAST,
    AgentProc,
    Rig,
    action,
    assert_steps_cover,
    last_step,
    pid_alive,
    rig_fixture,
    step_rows,
    summaries,
    train_cmd,
    workflow,
)

pytestmark = pytest.mark.slow


def messages(store: Store, action_id: int) -> str:
    return " | ".join(e["message"] for e in action_log(store, action_id))


def drive_until(rig: Rig, action_id: int, state: str, options: MigrationOptions = FAST, timeout: float = 60) -> None:
    def step() -> bool:
        return drive(rig.store, action_id, settings=rig.settings, options=options) == state

    wait_for(step, timeout=timeout, every=0.1)


def command_status(store: Store, action_id: int, kind: str) -> str | None:
    with store.session() as s:
        row = s.scalar(select(Command).where(Command.action_id == action_id, Command.kind == kind)
                       .order_by(Command.id.desc()).limit(1))
        return None if row is None else row.status


def test_job_killed_during_its_checkpoint_is_restarted_where_it_was_from_its_last_checkpoint(rig: Rig) -> None:
    total = 70
    # a bigger model, so that saving one takes long enough to be caught in the act; also saves every 10 steps
    job = rig.launch(train_cmd(total, "--hidden", "1536", "--save-every", "10", step_sleep=0.05), name="ckpt-kill",
                     steps=total)
    folder = Path(job.checkpoint_dir)
    wait_for(lambda: len(list(folder.glob("step-*.pt"))) >= 2, timeout=90)
    action_id = start_migration(rig.store, job.workflow_id, rig.other_device(job), settings=rig.settings)
    assert drive(rig.store, action_id, settings=rig.settings, options=FAST) == "checkpoint_requested"
    wait_for(lambda: command_status(rig.store, action_id, "checkpoint") == "running", timeout=30, every=0.01)
    # kill the job while a checkpoint file is being written (the partial file is proof it was mid-save)
    wait_for(lambda: list(folder.glob(".step-*.tmp")), timeout=30, every=0.002)
    os.kill(job.pid, signal.SIGKILL)
    complete = max(int(p.stem.split("-")[1]) for p in folder.glob("step-*.pt"))

    states = drive_actions(rig.store, action_ids=[action_id], settings=rig.settings,
                           migration_options=FAST, timeout_s=60)
    assert states == {action_id: "rolled_back"}, messages(rig.store, action_id)
    log = messages(rig.store, action_id)
    assert "exited before answering the checkpoint request" in log and "running again where it was" in log
    here = rig.placement(job.workflow_id)
    assert here.device_id == job.device_ids[0] and here.pid != job.pid  # back on its own device, a new process
    wait_for(lambda: workflow(rig.store, job.workflow_id).state == "finished", timeout=90)
    runs = summaries(Path(job.log_path))
    assert len(runs) == 1 and runs[0]["end_step"] == total
    assert runs[0]["start_step"] >= complete - 10 and runs[0]["start_step"] in {
        int(p.stem.split("-")[1]) for p in folder.glob("step-*.pt")}
    assert_steps_cover(rig.store, job.workflow_id, total)


def test_agent_killed_during_relaunch_is_restarted_and_the_move_completes(rig: Rig) -> None:
    total = 300
    job = rig.launch(train_cmd(total), name="agent-kill", steps=total)
    wait_for(lambda: last_step(rig.store, job.workflow_id) >= 30, timeout=60)
    target = rig.other_device(job)
    action_id = start_migration(rig.store, job.workflow_id, target, settings=rig.settings)
    drive_until(rig, action_id, "stopped")
    assert drive(rig.store, action_id, settings=rig.settings, options=FAST) == "stopped"  # sends the relaunch
    wait_for(lambda: command_status(rig.store, action_id, "relaunch") == "running", timeout=30, every=0.01)
    rig.agent.kill()  # mid-relaunch: the handler has claimed the command and is starting the job
    assert drive(rig.store, action_id, settings=rig.settings, options=FAST) == "stopped"  # nothing to do without it

    rig.agent = AgentProc(rig.home, host_id=rig.agent.host_id).start(rig.store)
    states = drive_actions(rig.store, action_ids=[action_id], settings=rig.settings,
                           migration_options=FAST, timeout_s=60)
    assert states == {action_id: "resumed"}, messages(rig.store, action_id)
    moved = action(rig.store, action_id)
    log = messages(rig.store, action_id)
    assert "again" in log  # the lost relaunch was sent again
    with rig.store.session() as s:
        relaunches = list(s.scalars(select(Command).where(Command.action_id == action_id, Command.kind == "relaunch")))
        assert relaunches[0].status == "failed" and "agent stopped" in relaunches[0].result["error"]
        running = list(s.scalars(select(Placement).where(Placement.workflow_id == job.workflow_id,
                                                         Placement.state == "active")))
    assert len(running) == 1 and running[0].device_id == target
    wait_for(lambda: workflow(rig.store, job.workflow_id).state == "finished", timeout=60)
    runs = summaries(Path(job.log_path))
    assert len(runs) == 1, "the job must run exactly once after the move (the re-sent relaunch found it running)"
    assert runs[0]["start_step"] == moved.checkpoint_step and runs[0]["end_step"] == total
    assert_steps_cover(rig.store, job.workflow_id, total)


def test_a_full_target_lane_refuses_the_move_before_anything_is_touched(rig: Rig) -> None:
    # target capacity is a plan-level check: it runs once, when the move is begun, never inside the actuator's steps
    # (a lane opened for a move under way stays reserved for it: admission counts it as taken)
    total = 300
    job = rig.launch(train_cmd(total), name="lane-full", steps=total, mem_bytes=64 << 20)
    wait_for(lambda: last_step(rig.store, job.workflow_id) >= 30, timeout=60)
    target = rig.other_device(job)
    from enforcer.managed import register_managed

    squatter = register_managed(rig.store, ["true"], settings=rig.settings, name="squatter", lane="auto",
                                mem_bytes=8 << 20)
    with rig.store.session() as s:
        lane = Lane(device_id=target, size_bytes=256 << 20, compute_share=0.5, state="open", created_at=time.time())
        s.add(lane)
        s.flush()
        lane_id = lane.id
        p = s.get(Placement, squatter.placement_ids[0])
        p.device_id, p.lane_id, p.mem_persistent, p.state = target, lane_id, 250 << 20, "active"

    with pytest.raises(MoveRefused, match=f"target lane {lane_id} is full.*runs on where it is"):
        start_migration(rig.store, job.workflow_id, target, to_lane_id=lane_id, settings=rig.settings)
    with rig.store.session() as s:
        assert s.scalars(select(Action).where(Action.workflow_id == job.workflow_id)).all() == []
        assert s.scalars(select(Command).where(Command.kind == "checkpoint")).all() == []
    here = rig.placement(job.workflow_id)
    assert (here.device_id, here.pid) == (job.device_ids[0], job.pid)
    wait_for(lambda: workflow(rig.store, job.workflow_id).state == "finished", timeout=60)
    runs = summaries(Path(job.log_path))
    assert len(runs) == 1 and runs[0]["end_step"] == total  # trained through, never stopped
    assert_steps_cover(rig.store, job.workflow_id, total)


def test_job_that_dies_at_the_target_before_its_first_step_is_put_back_from_its_checkpoint(rig: Rig) -> None:
    total = 14
    # one second a step: the relaunched job cannot report a step before the test kills it
    job = rig.launch(train_cmd(total, step_sleep=1.0), name="dies-there", steps=total)
    wait_for(lambda: last_step(rig.store, job.workflow_id) >= 2, timeout=60)
    target = rig.other_device(job)
    action_id = start_migration(rig.store, job.workflow_id, target, settings=rig.settings)
    drive_until(rig, action_id, "relaunched")
    moved = action(rig.store, action_id)
    relaunched_pid = rig.placement(job.workflow_id).pid
    assert rig.placement(job.workflow_id).device_id == target
    os.kill(relaunched_pid, signal.SIGKILL)  # it dies on the target before its first step
    wait_for(lambda: workflow(rig.store, job.workflow_id).state == "failed", timeout=30)  # the agent saw it die

    states = drive_actions(rig.store, action_ids=[action_id], settings=rig.settings,
                           migration_options=FAST, timeout_s=60)
    assert states == {action_id: "rolled_back"}, messages(rig.store, action_id)
    log = messages(rig.store, action_id)
    assert f"died as pid {relaunched_pid} on device {target} before it reported a step" in log
    assert "running again where it was" in log
    here = rig.placement(job.workflow_id)
    assert here.device_id == job.device_ids[0] and here.pid not in (job.pid, relaunched_pid)
    wait_for(lambda: workflow(rig.store, job.workflow_id).state == "finished", timeout=90)
    runs = summaries(Path(job.log_path))
    assert len(runs) == 1 and runs[0]["start_step"] == moved.checkpoint_step and runs[0]["end_step"] == total
    assert_steps_cover(rig.store, job.workflow_id, total)


@pytest.mark.pg
def test_database_unreachable_mid_move(fleet_home: Path, pg_url: str) -> None:
    """PostgreSQL behind a TCP proxy that is cut for 5 s while the relaunch runs: the agent writes the outcome it
    could not write when the database is back, before the relaunch expires (past its expiry it would have stopped the
    start it could not report, collector.job_fence.lapse); a relaunch that failed for the outage (the spec could not
    be read), or whose outcome never came, is sent again, and the job is started once."""
    upgrade(Store(pg_url))
    proxy = TcpProxy("127.0.0.1", int(Store(pg_url).url.port or 5432)).start()
    url = proxy.url(pg_url)
    settings = get_settings(fresh=True).model_copy(update={"db_url": url})
    store = Store(url, connect_timeout_s=2)
    agent = AgentProc(fleet_home, db_url=url).start(store)
    rig_ = Rig(fleet_home, store, agent, settings.model_copy(update={"host_id": agent.host_id}))
    try:
        total = 200
        job = rig_.launch(train_cmd(total), name="db-away", steps=total)
        wait_for(lambda: last_step(store, job.workflow_id) >= 20, timeout=60)
        action_id = start_migration(store, job.workflow_id, rig_.other_device(job), settings=rig_.settings)
        options = MigrationOptions(checkpoint_timeout_s=20, command_grace_s=15, resume_timeout_s=60)
        result: dict[int, str] = {}
        driver = threading.Thread(target=lambda: result.update(drive_actions(
            store, action_ids=[action_id], settings=rig_.settings, migration_options=options, timeout_s=90)))
        driver.start()
        direct = Store(pg_url)
        wait_for(lambda: command_status(direct, action_id, "relaunch") == "running", timeout=60, every=0.01)
        proxy.cut()  # the database goes away while the agent starts the job
        time.sleep(5)
        proxy.restore()
        driver.join(timeout=100)
        assert result == {action_id: "resumed"}, messages(direct, action_id)
        moved = action(direct, action_id)
        log = messages(direct, action_id)
        with direct.session() as s:
            relaunches = [c.status for c in s.scalars(select(Command).where(
                Command.action_id == action_id, Command.kind == "relaunch").order_by(Command.id))]
        # the outcome the database could not take was written when it was back, or the relaunch was sent again
        assert relaunches[-1] == "done" and "done" not in relaunches[:-1], (relaunches, log)
        wait_for(lambda: workflow(direct, job.workflow_id).state == "finished", timeout=60)
        runs = summaries(Path(job.log_path))
        assert len(runs) == 1 and runs[0]["start_step"] == moved.checkpoint_step and runs[0]["end_step"] == total
        rows = step_rows(direct, job.workflow_id)
        assert max(r.last_step for r in rows) == total - 1
        assert_steps_cover(direct, job.workflow_id, total)
        assert pid_alive(agent.proc.pid)  # the agent rode out the outage
        direct.dispose()
    finally:
        agent.stop()
        proxy.cut()
        store.dispose()
