"""What an agent refuses to run, and moves that roll back instead of losing work, with real parts: a real agent,
real torch jobs. A relaunch spec changed in the store is refused (and said so in the action log); a checkpoint
whose bytes changed after it was recorded is refused; a relaunched job that resumes below its checkpoint step, or
reports no step in time, is stopped and put back where it was."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from enforcer.actuators.drive import drive_actions
from enforcer.migration import MigrationOptions, action_log, drive, start_migration
from store.errors import InvalidInput
from store.models import Workflow
from tests.collector.agent_helpers import wait_for
from tests.enforcer.migration_helpers import (  # noqa: F401  (rig_fixture: the `rig` fixture)
    FAST,
    Rig,
    action,
    commands,
    last_step,
    pid_alive,
    rig_fixture,
    step_rows,
    train_cmd,
    workflow,
)

pytestmark = pytest.mark.slow


def _drive_to(rig: Rig, action_id: int, state: str, options: MigrationOptions = FAST) -> None:
    def reached() -> bool:
        now = drive(rig.store, action_id, settings=rig.settings, options=options)
        assert now not in ("failed", "rolled_back", "resumed") or now == state, action_log(rig.store, action_id)
        return now == state

    wait_for(reached, timeout=90, every=0.2)


def test_a_relaunch_spec_changed_in_the_store_is_refused_and_nothing_unverified_runs(rig: Rig) -> None:
    job = rig.launch(train_cmd(100_000, step_sleep=0.05), name="tampered")
    wait_for(lambda: last_step(rig.store, job.workflow_id) >= 5, timeout=60)
    action_id = start_migration(rig.store, job.workflow_id, rig.other_device(job), settings=rig.settings)
    _drive_to(rig, action_id, "stopped")
    with rig.store.session() as s:  # whoever can write the database tries to choose what runs
        s.get(Workflow, job.workflow_id).command = [sys.executable, "-c", "open('/tmp/owned', 'w')"]
    states = drive_actions(rig.store, action_ids=[action_id], settings=rig.settings,
                           migration_options=FAST, timeout_s=60)
    assert states == {action_id: "failed"}
    relaunches = [c for c in commands(rig.store, action_id) if c.kind == "relaunch"]
    assert relaunches and all(c.status == "failed" and c.result["unsafe"] for c in relaunches)
    assert len(relaunches) == 2  # the move's and the roll-back's, each refused once: no retries of the unsafe
    log = " | ".join(e["message"] for e in action_log(rig.store, action_id))
    assert "refused to start" in log and "does not match the digest signed when it was registered" in log
    assert "nothing unverified was run" in action(rig.store, action_id).error
    assert workflow(rig.store, job.workflow_id).state == "failed"
    assert not pid_alive(job.pid)
    assert [r for r in step_rows(rig.store, job.workflow_id) if r.pid != job.pid] == []  # nothing else ran
    # a spec changed before a move: refused in the plan, the job is not touched
    job2 = rig.launch(train_cmd(100_000, step_sleep=0.05), name="tampered-early")
    with rig.store.session() as s:
        s.get(Workflow, job2.workflow_id).cwd = "/"
    with pytest.raises(InvalidInput, match="refused: the relaunch spec"):
        start_migration(rig.store, job2.workflow_id, rig.other_device(job2), settings=rig.settings)
    assert pid_alive(job2.pid)


def test_a_checkpoint_changed_after_it_was_recorded_is_refused(rig: Rig) -> None:
    job = rig.launch(train_cmd(100_000, step_sleep=0.05), name="corrupt")
    wait_for(lambda: last_step(rig.store, job.workflow_id) >= 5, timeout=60)
    action_id = start_migration(rig.store, job.workflow_id, rig.other_device(job), settings=rig.settings)
    _drive_to(rig, action_id, "checkpointed")
    ckpt = Path(action(rig.store, action_id).checkpoint_path)
    with open(ckpt, "ab") as f:
        f.write(b"bit rot")
    states = drive_actions(rig.store, action_ids=[action_id], settings=rig.settings,
                           migration_options=FAST, timeout_s=60)
    assert states == {action_id: "failed"}
    log = " | ".join(e["message"] for e in action_log(rig.store, action_id))
    assert "does not match what was recorded when it was written" in log
    assert [r for r in step_rows(rig.store, job.workflow_id) if r.pid != job.pid] == []


def test_a_relaunch_that_resumes_below_its_checkpoint_step_is_stopped_and_put_back(rig: Rig) -> None:
    # the relaunched job ignores its checkpoint (starts from step 0): accepting that would redo or lose work
    command = ["env", "-u", "FLEETLENS_RESUME_FROM", "-u", "FLEETLENS_RESUME_STEP",
               *train_cmd(100_000, step_sleep=0.05)]
    job = rig.launch(command, name="forgetful")
    wait_for(lambda: last_step(rig.store, job.workflow_id) >= 20, timeout=60)
    action_id = start_migration(rig.store, job.workflow_id, rig.other_device(job), settings=rig.settings)
    states = drive_actions(rig.store, action_ids=[action_id], settings=rig.settings,
                           migration_options=FAST, timeout_s=120)
    assert states == {action_id: "rolled_back"}, action_log(rig.store, action_id)
    moved = action(rig.store, action_id)
    log = " | ".join(e["message"] for e in action_log(rig.store, action_id))
    assert f"below its checkpoint step {moved.checkpoint_step}" in log
    relaunched = [c for c in commands(rig.store, action_id) if c.kind == "relaunch"]
    target_pid = relaunched[0].result["pid"]
    assert not pid_alive(target_pid)  # stopped at the target
    here = rig.placement(job.workflow_id)
    assert here.device_id == job.device_ids[0] and pid_alive(here.pid)  # back where it was


def test_a_relaunched_job_that_reports_no_step_in_time_is_stopped_and_put_back(rig: Rig) -> None:
    train = " ".join(train_cmd(100_000, step_sleep=0.05))
    command = ["sh", "-c", f'if [ -n "$FLEETLENS_RESUME_FROM" ]; then exec sleep 300; fi; exec {train}']
    job = rig.launch(command, name="hangs")
    wait_for(lambda: last_step(rig.store, job.workflow_id) >= 5, timeout=60)
    options = MigrationOptions(checkpoint_timeout_s=20, command_grace_s=5, resume_timeout_s=4)
    action_id = start_migration(rig.store, job.workflow_id, rig.other_device(job), settings=rig.settings)
    states = drive_actions(rig.store, action_ids=[action_id], settings=rig.settings,
                           migration_options=options, timeout_s=120)
    assert states == {action_id: "rolled_back"}, action_log(rig.store, action_id)
    log = " | ".join(e["message"] for e in action_log(rig.store, action_id))
    assert "reported no step within 4 s" in log and "putting it back where it was" in log
    relaunched = [c for c in commands(rig.store, action_id) if c.kind == "relaunch"]
    assert not pid_alive(relaunched[0].result["pid"])  # the hung process at the target was stopped
    here = rig.placement(job.workflow_id)
    assert here.device_id == job.device_ids[0] and pid_alive(here.pid)
    assert workflow(rig.store, job.workflow_id).state == "running"
