"""Migration with real parts: a real agent (subprocess, cpu source), real torch training jobs, SQLite; a job moved
mid-training between two cpu devices resumes from its checkpoint and finishes. Bad input leaves the job alone."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import psutil
import pytest
from sqlalchemy import select

from enforcer.actuators.drive import drive_actions
from enforcer.managed import register_managed
from enforcer.migration import MigrationOptions, action_log, drive, start_migration
from enforcer.plan_store import apply_plan, make_plan
from store.db import Store
from store.errors import InvalidInput, NotFound
from store.models import Action, Placement, Plan, Workflow
from store.settings import get_settings
from store.workflows import sign_workflow_spec
from tests.collector.agent_helpers import wait_for
from tests.conftest import PROJECT_ROOT
from tests.enforcer.migration_helpers import (  # noqa: F401  (rig_fixture: the `rig` fixture)
    FAST,
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
from ui.serve.run import start_local

pytestmark = pytest.mark.slow


def test_a_job_moved_mid_training_resumes_from_its_checkpoint_and_finishes(rig: Rig) -> None:
    """The demo's path: a recorded plan moves the job into a new lane on the other cpu device; applying it makes
    the action, driving it carries the move out."""
    total = 300
    job = rig.launch(train_cmd(total), steps=total, name="mover", mem_bytes=64 << 20)
    assert job.pid and pid_alive(job.pid)
    wait_for(lambda: last_step(rig.store, job.workflow_id) >= 40, timeout=60)
    target = rig.other_device(job)
    move = {"workflow_id": job.workflow_id, "from_device_id": job.device_ids[0], "to_device_id": target,
            "to_lane_id": None, "new_lane": "new-1", "lane_size": 1 << 30, "p_prime": 71 << 20, "ephemeral": 0,
            "util": 0.5, "compute_share": 0.5, "expected_slowdown": 1.0, "rules": ["idle_holder"]}
    with rig.store.session() as s:
        plan = Plan(created_at=time.time(), policy="pack", moves=[move], summary={})
        s.add(plan)
        s.flush()
        plan_id = plan.id
    (planned,) = apply_plan(rig.store, plan_id, settings=rig.settings)
    action_id = planned.id

    states = drive_actions(rig.store, plan_id=plan_id, settings=rig.settings, migration_options=FAST, timeout_s=60)
    assert states == {action_id: "resumed"}, action_log(rig.store, action_id)
    moved = action(rig.store, action_id)
    assert moved.checkpoint_step is not None and moved.checkpoint_step >= 40
    assert Path(moved.checkpoint_path).is_file()
    assert not pid_alive(job.pid)  # the old process is gone ...
    here = rig.placement(job.workflow_id)
    assert (here.device_id, here.lane_id) == (target, moved.to_lane_id) and here.pid != job.pid  # ... it runs there
    env = psutil.Process(here.pid).environ()  # started in its lane: the SDK takes turns through the agent's gate
    assert env["FLEETLENS_LANE"] == str(moved.to_lane_id) and env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    target_cores = next(d.cpu_cores for d in rig.agent.devices(rig.store) if d.id == target)
    assert sorted(psutil.Process(here.pid).cpu_affinity()) == target_cores

    wait_for(lambda: workflow(rig.store, job.workflow_id).state == "finished", timeout=60)
    runs = summaries(Path(job.log_path))
    assert [r["start_step"] for r in runs] == [moved.checkpoint_step]  # the first run was stopped, not finished
    assert runs[-1]["end_step"] == total and runs[-1]["resumed_from"] == moved.checkpoint_path
    # no step before the checkpoint was lost: the first process reported up to it, the second from it to the end
    rows = step_rows(rig.store, job.workflow_id)
    first = [r for r in rows if r.pid == job.pid]
    second = [r for r in rows if r.pid == here.pid]
    assert min(r.first_step for r in first) == 0 and max(r.last_step for r in first) >= moved.checkpoint_step - 1
    assert min(r.first_step for r in second) == moved.checkpoint_step
    assert max(r.last_step for r in second) == total - 1
    assert_steps_cover(rig.store, job.workflow_id, total)

    states_seen = [e["to_state"] for e in action_log(rig.store, action_id)]
    for state in ("planned", "checkpoint_requested", "checkpointed", "stopped", "relaunched", "resumed"):
        assert state in states_seen
    messages = " | ".join(e["message"] for e in action_log(rig.store, action_id))
    assert f"checkpoint at step {moved.checkpoint_step}" in messages and f"resumed at step {moved.checkpoint_step}" \
        in messages
    # driving a finished action again changes nothing
    assert drive(rig.store, action_id, settings=rig.settings, options=FAST) == "resumed"


def test_an_unwritable_checkpoint_folder_fails_the_move_and_leaves_the_job_running(rig: Rig) -> None:
    job = rig.launch(train_cmd(100_000, step_sleep=0.05), name="nowrite")
    wait_for(lambda: last_step(rig.store, job.workflow_id) >= 5, timeout=60)
    blocker = rig.home / "not-a-folder"
    blocker.write_text("a file where the checkpoint folder should be")
    with rig.store.session() as s:  # registered so (signed): a folder that cannot be made
        wf = s.get(Workflow, job.workflow_id)
        wf.checkpoint_dir = str(blocker / "ckpt")
        sign_workflow_spec(wf, rig.settings.secret_bytes())
    before = rig.placement(job.workflow_id)

    action_id = start_migration(rig.store, job.workflow_id, rig.other_device(job), settings=rig.settings)
    states = drive_actions(rig.store, action_ids=[action_id], settings=rig.settings,
                           migration_options=FAST, timeout_s=60)
    assert states == {action_id: "failed"}
    failed = action(rig.store, action_id)
    assert "could not checkpoint" in failed.error and "nothing moved" in failed.error
    assert "Error" in failed.error  # the job's own error (NotADirectoryError / FileExistsError) is in the message
    # the job was left as it was: same process, same device, still training
    assert pid_alive(job.pid)
    after = rig.placement(job.workflow_id)
    assert (after.id, after.device_id, after.pid) == (before.id, before.device_id, job.pid)
    assert workflow(rig.store, job.workflow_id).state == "running"
    step = last_step(rig.store, job.workflow_id)
    wait_for(lambda: last_step(rig.store, job.workflow_id) > step, timeout=30)


def test_a_job_that_never_answers_its_checkpoint_request_is_left_as_it_was(rig: Rig) -> None:
    # a managed job without the fleetlens SDK: it can be started, but never checkpoints
    job = rig.launch([sys.executable, "-c", "import time; time.sleep(120)"], name="silent")
    before = rig.placement(job.workflow_id)
    options = MigrationOptions(checkpoint_timeout_s=2, command_grace_s=5)
    action_id = start_migration(rig.store, job.workflow_id, rig.other_device(job), settings=rig.settings)
    states = drive_actions(rig.store, action_ids=[action_id], settings=rig.settings,
                           migration_options=options, timeout_s=60)
    assert states == {action_id: "failed"}
    error = action(rig.store, action_id).error
    assert "did not answer the checkpoint request within 2 s" in error and "nothing moved" in error
    assert pid_alive(job.pid)
    after = rig.placement(job.workflow_id)
    assert (after.id, after.device_id, after.pid) == (before.id, before.device_id, job.pid)
    assert workflow(rig.store, job.workflow_id).state == "running"


def test_a_plan_naming_a_workflow_that_has_gone_moves_nothing(fleet_home: Path, sqlite_store: Store) -> None:
    # no agent needed: the plan is refused before any command is sent
    from store.registry import DeviceSpec, register_devices, register_host

    settings = get_settings(fresh=True).model_copy(update={"host_id": "h1"})
    with sqlite_store.session() as s:
        register_host(s, "h1", hostname="h1", source="cpu")
        ids = register_devices(s, "h1", [DeviceSpec(i, f"cpu:h1:{i}", f"cpu core {i}", 8 << 30, (i,))
                                         for i in range(2)], source="cpu")
    job = register_managed(sqlite_store, [sys.executable, "-c", "import time; time.sleep(60)"], settings=settings,
                           movable=True, name="stays", cwd=PROJECT_ROOT)
    proc = start_local(sqlite_store, job)
    try:
        moves = [
            {"workflow_id": wf, "from_device_id": job.device_ids[0], "to_device_id": ids[1], "to_lane_id": None,
             "new_lane": "new-1", "lane_size": 1 << 30, "p_prime": 1 << 20, "ephemeral": 0, "util": 0.1,
             "compute_share": 0.5, "expected_slowdown": 1.0, "rules": ["idle_holder"]}
            for wf in (job.workflow_id, "gone-workflow")
        ]
        with sqlite_store.session() as s:
            plan = Plan(created_at=time.time(), policy="pack", moves=moves, summary={})
            s.add(plan)
            s.flush()
            plan_id = plan.id
        with pytest.raises(NotFound, match="gone-workflow.*no longer in the store.*nothing was moved"):
            apply_plan(sqlite_store, plan_id, settings=settings)
        with sqlite_store.session() as s:
            assert s.scalars(select(Action)).all() == []
            assert s.get(Plan, plan_id).applied is False
            here = s.scalar(select(Placement).where(Placement.workflow_id == job.workflow_id))
            assert (here.state, here.device_id, here.pid) == ("active", job.device_ids[0], proc.pid)
        assert proc.poll() is None
        # a hand-made move of a workflow that is not there is refused the same way
        with pytest.raises(NotFound, match="no workflow 'gone-workflow'"):
            start_migration(sqlite_store, "gone-workflow", ids[1], settings=settings)
        with pytest.raises(InvalidInput, match="unknown policy"):
            make_plan(sqlite_store, "bogus", settings=settings)
    finally:
        proc.kill()
        proc.wait()
