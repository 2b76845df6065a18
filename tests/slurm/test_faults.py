"""The Slurm actuator's faults, each against the real cluster with a real torch job on the SDK: the job dying while
it checkpoints; a stale checkpoint and a refused requeue; no free shard left (slurmctld restarted in the middle of a
move is in test_move.py, on the whole move). In every case no job is lost, no job runs twice, and the action log
says what became of it."""

from __future__ import annotations

import time

import psutil
import pytest
from sqlalchemy import select

from collector.importers.slurm import import_slurm
from enforcer.actuators.base import Move
from enforcer.actuators.slurm import SlurmActuator, SlurmMoveOptions
from store.models import Action, ActionEvent
from store.slurm_marks import job_folder, read_started
from tests.slurm.cluster import drive_to_end, job_processes, train_command

pytestmark = pytest.mark.slurm


def _begin(sqlite_store, settings, job_id: int, options: SlurmMoveOptions | None = None) -> tuple[SlurmActuator, int]:
    import_slurm(sqlite_store, settings)
    actuator = SlurmActuator(sqlite_store, settings, options=options)
    return actuator, actuator.begin(Move(workflow_id=f"slurm-{job_id}", to_device_id=0, request={"gres": "shard:1"}),
                                    now=time.time())


def _advance_to(actuator: SlurmActuator, action_id: int, state: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while actuator.state(action_id) != state:
        assert actuator.state(action_id) not in ("resumed", "rolled_back", "failed"), _log(actuator, action_id)
        assert time.monotonic() < deadline, f"not {state} in {timeout} s: {_log(actuator, action_id)}"
        actuator.advance(action_id, now=time.time())
        time.sleep(0.3)


def _log(actuator: SlurmActuator, action_id: int) -> list[tuple[str, str]]:
    with actuator.store.session() as s:
        return [(e.to_state, e.message) for e in s.scalars(
            select(ActionEvent).where(ActionEvent.action_id == action_id).order_by(ActionEvent.id))]


def _error(actuator: SlurmActuator, action_id: int) -> str:
    with actuator.store.session() as s:
        return s.get(Action, action_id).error or ""


def test_job_that_dies_while_checkpointing_is_left_as_it_ended(slurm, job_env, sqlite_store, slurm_settings,
                                                               tmp_path):
    # one step takes 3 s, so the signal waits for the step's end and the job is killed before it checkpoints
    job = slurm.submit(train_command(idle_s=3.0), gres="shard:2", comment="fleetlens:movable", env=job_env,
                       cwd=tmp_path)
    slurm.wait_running(job)
    actuator, action_id = _begin(sqlite_store, slurm_settings, job)
    _advance_to(actuator, action_id, "signalled")
    for proc in job_processes(job):
        proc.kill()
    assert drive_to_end(actuator, action_id, timeout_s=30) == "failed"
    assert "while it was asked to checkpoint" in _error(actuator, action_id)
    assert "changed nothing else" in _error(actuator, action_id)
    state = slurm.job(job)
    # it died on its own; fleetlens requeued nothing
    assert state["job_state"] == "FAILED" and state["restart_cnt"] == 0


def test_stale_checkpoint_and_refused_requeue_leave_the_job_running_untouched(slurm, job_env, sqlite_store,
                                                                              slurm_settings, tmp_path):
    job = slurm.submit(train_command(), gres="shard:2", comment="fleetlens:movable", env=job_env, cwd=tmp_path)
    slurm.wait_running(job)
    # every checkpoint is older than a limit this small: asked for again, then given up, nothing changed
    stale = SlurmMoveOptions(checkpoint_timeout_s=60, checkpoint_max_age_s=1e-6, max_attempts=2)
    actuator, action_id = _begin(sqlite_store, slurm_settings, job, options=stale)
    assert drive_to_end(actuator, action_id, timeout_s=60) == "failed"
    assert "older than the limit" in _error(actuator, action_id)
    assert [s for s, _ in _log(actuator, action_id)].count("signalled") == 2  # a fresh one was asked for once more
    # the requeue refused: the job stopped being requeueable after it was planned
    actuator, action_id = _begin(sqlite_store, slurm_settings, job)
    _advance_to(actuator, action_id, "checkpointed")
    slurm.run("scontrol", "update", f"jobid={job}", "requeue=0")
    assert drive_to_end(actuator, action_id, timeout_s=30) == "failed"
    assert "Slurm refused the requeue" in _error(actuator, action_id)
    state = slurm.job(job)
    assert (state["job_state"], state["restart_cnt"], state["tres_per_node"]) == ("RUNNING", 0, "gres:shard:2")
    assert len(job_processes(job)) == 1


def test_no_free_shard_left_rolls_back_and_the_job_resumes_from_its_checkpoint(slurm, job_env, sqlite_store,
                                                                                slurm_settings, tmp_path):
    job = slurm.submit(train_command(), gres="shard:2", comment="fleetlens:movable", env=job_env, cwd=tmp_path)
    slurm.wait_running(job)
    fillers = [slurm.submit("sleep 300", gres="shard:2", cwd=tmp_path, name=f"fill{i}") for i in range(3)]
    slurm.wait_running(*fillers)
    actuator, action_id = _begin(sqlite_store, slurm_settings, job)
    _advance_to(actuator, action_id, "held")
    taker = slurm.submit("sleep 300", gres="shard:2", cwd=tmp_path, name="taker")  # takes the shards it let go
    slurm.wait_running(taker)
    assert drive_to_end(actuator, action_id, timeout_s=30) == "rolled_back"
    message = _error(actuator, action_id)
    assert "no free shard is left" in message
    with sqlite_store.session() as s:
        ckpt_step = s.get(Action, action_id).checkpoint_step
    state = slurm.job(job)  # waiting in Slurm's queue with its old request: not lost
    assert (state["job_state"], state["tres_per_node"]) == ("PENDING", "gres:shard:2")
    slurm.run("scancel", str(taker))
    slurm.wait_running(job)
    folder = job_folder(slurm_settings, f"slurm-{job}")
    started = slurm.wait(lambda: (s := read_started(folder)) is not None and s.restart_count == 1 and s, timeout=60)
    assert started.step >= ckpt_step and started.restored_sha256 is not None
    assert len(job_processes(job)) == 1 and psutil.pid_exists(job_processes(job)[0].pid)
