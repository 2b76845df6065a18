"""The Slurm actuator's steps against a fake Slurm at the command line's boundary (the real cluster's tests are in
tests/slurm/): a move is decided from what Slurm says of the job now, not from the store's row of the last import; the
resume is checked against the run the move started; a job someone else released while it was held ends the move;
a job whose node Slurm drains or sets down during the move is not requeued (it could not start there again), or, if
held already, gets its old request back; and two enforcers never begin two moves of one job."""

from __future__ import annotations

import hashlib
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import event, select
from sqlalchemy.orm import Session

from collector.importers.slurm import import_slurm
from enforcer.actuators.base import Move
from enforcer.actuators.slurm import TERMINAL, SlurmActuator, SlurmMoveOptions
from enforcer.actuators.slurm_reads import read_job
from store.errors import InvalidInput
from store.models import Action, ActionEvent
from store.settings import Settings
from store.slurm_marks import CHECKPOINT_MANIFEST, STARTED, CheckpointManifest, Started, job_folder, write_mark
from tests.fakes.fake_slurm import FakeSlurm

JOB = 5
WF = f"slurm-{JOB}"


@pytest.fixture
def settings(fleet_home: Path) -> Settings:
    return Settings(home=fleet_home)


def _started(settings: Settings, restart: int, step: int = 0, sha: str | None = None) -> None:
    """The start mark the job's SDK writes when run `restart` begins (at `step`, from the checkpoint `sha`)."""
    write_mark(job_folder(settings, WF), STARTED, Started(job_id=JOB, restart_count=restart, step=step, gpus="0",
                                                          started_at=time.time(), restored_sha256=sha,
                                                          batch_step=True))


def _checkpoint(settings: Settings, tmp_path: Path, restart: int, step: int, now: float) -> str:
    """The checkpoint the SDK writes on the signal, and its manifest; its sha256."""
    path = tmp_path / f"ckpt-{step}.pt"
    path.write_bytes(f"weights at step {step}".encode())
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    write_mark(job_folder(settings, WF), CHECKPOINT_MANIFEST, CheckpointManifest(
        job_id=JOB, restart_count=restart, step=step, path=str(path), size_bytes=path.stat().st_size, sha256=sha,
        written_at=now))
    return sha


def _events(store, action_id: int) -> list[tuple[str, str]]:
    with store.session() as s:
        return [(e.to_state, e.message) for e in s.scalars(
            select(ActionEvent).where(ActionEvent.action_id == action_id).order_by(ActionEvent.id))]


def _to_held(store, settings: Settings, slurm: FakeSlurm, tmp_path: Path, *, restart: int, now: float,
             options: SlurmMoveOptions | None = None) -> tuple[SlurmActuator, int, str]:
    """A move to shard:1 begun and carried to `held`: signalled, checkpointed at step 8, requeued and held."""
    actuator = SlurmActuator(store, settings, cli=slurm, options=options)
    action_id = actuator.begin(Move(workflow_id=WF, to_device_id=0, request={"gres": "shard:1"}), now=now)
    actuator.advance(action_id, now=now)
    assert actuator.state(action_id) == "signalled", _events(store, action_id)
    sha = _checkpoint(settings, tmp_path, restart, 8, now + 1)
    for t in (2, 3):
        actuator.advance(action_id, now=now + t)
    assert actuator.state(action_id) == "held", _events(store, action_id)
    return actuator, action_id, sha


def test_a_move_from_a_stale_row_never_raises_the_request(sqlite_store, settings):
    slurm = FakeSlurm()
    slurm.submit(JOB, "shard:4")
    import_slurm(sqlite_store, settings, cli=slurm)
    # a first move took it to shard:1 (requeued once) since that import: the store's row still says shard:4
    slurm.jobs[JOB].update(tres_per_node="gres:shard:1", restart_cnt=1)
    _started(settings, restart=1, step=5)
    actuator = SlurmActuator(sqlite_store, settings, cli=slurm)
    now = time.time()
    action_id = actuator.begin(Move(workflow_id=WF, to_device_id=0, request={"gres": "shard:2"}), now=now)
    assert actuator.advance(action_id, now=now)[0].ok is False
    assert actuator.state(action_id) == "failed"
    with sqlite_store.session() as s:
        error = s.get(Action, action_id).error
    assert "holds shard:1 now" in error and "never raises" in error and "nothing was done" in error
    assert slurm.sent == []  # not signalled, not requeued, not changed
    assert slurm.jobs[JOB]["tres_per_node"] == "gres:shard:1"


def test_the_resume_is_checked_against_the_run_the_move_started(sqlite_store, settings, tmp_path):
    slurm = FakeSlurm()
    slurm.submit(JOB, "shard:4")
    import_slurm(sqlite_store, settings, cli=slurm)
    # requeued once since the import (the row says restart 0); that run started at step 5 and says so
    slurm.jobs[JOB]["restart_cnt"] = 1
    _started(settings, restart=1, step=5)
    now = time.time()
    actuator, action_id, sha = _to_held(sqlite_store, settings, slurm, tmp_path, restart=1, now=now)
    for t in (4, 5):  # updated, released
        actuator.advance(action_id, now=now + t)
    assert actuator.state(action_id) == "released" and slurm.jobs[JOB]["tres_per_node"] == "gres:shard:1"
    slurm.start(JOB, gpu=2)
    # the start mark is still the earlier run's (restart 1, step 5): it says nothing of the run this move started
    assert actuator.advance(action_id, now=now + 6) == [] and actuator.state(action_id) == "released"
    _started(settings, restart=2, step=8, sha=sha)
    actuator.advance(action_id, now=now + 7)
    assert actuator.state(action_id) == "resumed", _events(sqlite_store, action_id)
    assert "resumed at step 8 (checkpoint 8)" in _events(sqlite_store, action_id)[-1][1]


def test_a_job_released_by_someone_else_while_held_ends_the_move(sqlite_store, settings, tmp_path):
    slurm = FakeSlurm()
    slurm.submit(JOB, "shard:4")
    import_slurm(sqlite_store, settings, cli=slurm)
    _started(settings, restart=0)
    now = time.time()
    actuator, action_id, _ = _to_held(sqlite_store, settings, slurm, tmp_path, restart=0, now=now)
    slurm.run("scontrol", "release", str(JOB))  # its owner, or an admin
    slurm.start(JOB)
    slurm.sent.clear()
    actuator.advance(action_id, now=now + 4)
    assert actuator.state(action_id) == "failed"
    with sqlite_store.session() as s:
        error = s.get(Action, action_id).error
    assert "released by someone else" in error and "old request shard:4" in error and "step 8" in error
    assert slurm.sent == [] and slurm.jobs[JOB]["tres_per_node"] == "gres:shard:4"
    # the job can be moved again
    _started(settings, restart=1, step=8)
    again = actuator.begin(Move(workflow_id=WF, to_device_id=0, request={"gres": "shard:1"}), now=now + 5)
    assert actuator.state(again) == "planned"


def test_a_job_that_never_comes_back_to_the_queue_after_its_hold_is_rolled_back(sqlite_store, settings, tmp_path):
    slurm = FakeSlurm()
    slurm.submit(JOB, "shard:4")
    import_slurm(sqlite_store, settings, cli=slurm)
    _started(settings, restart=0)
    now = time.time()
    options = SlurmMoveOptions(resume_timeout_s=60)
    actuator, action_id, _ = _to_held(sqlite_store, settings, slurm, tmp_path, restart=0, now=now, options=options)
    slurm.jobs[JOB]["job_state"] = "COMPLETING"  # its old run does not end
    assert actuator.advance(action_id, now=now + 30) == [] and actuator.state(action_id) == "held"
    actuator.advance(action_id, now=now + 70)
    assert actuator.state(action_id) == "rolling_back"
    assert "not back in Slurm's queue within 60 s" in _events(sqlite_store, action_id)[-1][1]
    slurm.jobs[JOB].update(job_state="PENDING", state_reason="JobHeldUser")
    actuator.advance(action_id, now=now + 71)
    assert actuator.state(action_id) == "rolled_back"
    assert ("scontrol", "release", str(JOB)) in slurm.sent and slurm.jobs[JOB]["tres_per_node"] == "gres:shard:4"


@pytest.mark.parametrize(("state", "flags", "said"), [("mixed", ["DRAIN"], "MIXED+DRAIN"), ("down", [], "DOWN"),
                                                     ("mixed", ["NOT_RESPONDING"], "MIXED+NOT_RESPONDING")])
def test_a_job_whose_node_is_drained_or_down_after_its_checkpoint_is_not_requeued(sqlite_store, settings, tmp_path,
                                                                                  state, flags, said):
    slurm = FakeSlurm()
    slurm.submit(JOB, "shard:4")
    import_slurm(sqlite_store, settings, cli=slurm)
    _started(settings, restart=0)
    now = time.time()
    actuator = SlurmActuator(sqlite_store, settings, cli=slurm)
    action_id = actuator.begin(Move(workflow_id=WF, to_device_id=0, request={"gres": "shard:1"}), now=now)
    actuator.advance(action_id, now=now)
    _checkpoint(settings, tmp_path, 0, 8, now + 1)
    actuator.advance(action_id, now=now + 2)
    assert actuator.state(action_id) == "checkpointed", _events(sqlite_store, action_id)
    slurm.node_state.update(state=state, state_flags=flags, reason="admin")  # before the requeue
    actuator.advance(action_id, now=now + 3)
    assert actuator.state(action_id) == "failed", _events(sqlite_store, action_id)
    with sqlite_store.session() as s:
        error = s.get(Action, action_id).error
    assert f"node gpu01 takes no move now: Slurm's latest listing shows it {said} (reason: admin)" in error
    assert "nothing was changed" in error
    assert [c[0] for c in slurm.sent] == ["scancel"]  # signalled for its checkpoint, never requeued
    assert (slurm.jobs[JOB]["job_state"], slurm.jobs[JOB]["tres_per_node"]) == ("RUNNING", "gres:shard:4")


def test_a_held_job_whose_node_was_drained_meanwhile_gets_its_old_request_back(sqlite_store, settings, tmp_path):
    slurm = FakeSlurm()
    slurm.submit(JOB, "shard:4")
    import_slurm(sqlite_store, settings, cli=slurm)
    _started(settings, restart=0)
    now = time.time()
    actuator, action_id, _ = _to_held(sqlite_store, settings, slurm, tmp_path, restart=0, now=now)
    slurm.node_state.update(state="idle", state_flags=["DRAIN"], reason="admin")
    actuator.advance(action_id, now=now + 4)
    assert actuator.state(action_id) == "rolling_back"
    assert "takes no move now" in _events(sqlite_store, action_id)[-1][1]
    actuator.advance(action_id, now=now + 5)
    assert actuator.state(action_id) == "rolled_back"
    assert ("scontrol", "update", f"jobid={JOB}", "gres=shard:1") not in slurm.sent
    assert slurm.jobs[JOB]["tres_per_node"] == "gres:shard:4"


def test_two_enforcers_never_begin_two_moves_of_one_job(any_store, settings):
    slurm = FakeSlurm()
    slurm.submit(JOB, "shard:4")
    import_slurm(any_store, settings, cli=slurm)
    move = Move(workflow_id=WF, to_device_id=0, request={"gres": "shard:1"})
    first_checked, go_on = threading.Event(), threading.Event()

    def pause_first(session, *_):  # the first enforcer is past its checks, about to write its action
        if threading.current_thread().name == "first" and not first_checked.is_set():
            first_checked.set()
            go_on.wait(30)

    results: dict[str, object] = {}

    def begin(name: str) -> None:
        try:
            results[name] = SlurmActuator(any_store, settings, cli=slurm).begin(move, now=time.time())
        except InvalidInput as exc:
            results[name] = exc

    event.listen(Session, "before_flush", pause_first)
    try:
        first = threading.Thread(target=begin, args=("first",), name="first")
        first.start()
        assert first_checked.wait(30)
        second = threading.Thread(target=begin, args=("second",), name="second")
        second.start()
        second.join(timeout=2)  # without a lock it begins its own move meanwhile; with one it waits for the first
        go_on.set()
        first.join(30)
        second.join(30)
    finally:
        go_on.set()
        event.remove(Session, "before_flush", pause_first)
    assert isinstance(results["first"], int)
    assert isinstance(results["second"], InvalidInput) and "already being moved" in str(results["second"])
    with any_store.session() as s:
        assert s.scalars(select(Action.id).where(Action.workflow_id == WF, Action.state.not_in(TERMINAL))).all() \
            == [results["first"]]


def test_a_job_that_opted_in_by_its_sdk_stays_movable_after_a_requeue_until_its_new_run_writes_its_mark(
        sqlite_store, settings):
    slurm = FakeSlurm()
    slurm.submit(JOB, "shard:4", submit_time=1000.0)
    slurm.jobs[JOB]["comment"] = ""  # no opt-in comment: only its SDK's start mark asks
    write_mark(job_folder(settings, WF), STARTED, Started(job_id=JOB, restart_count=0, step=0, gpus="0",
                                                          started_at=1500.0, movable=True, batch_step=True))
    import_slurm(sqlite_store, settings, cli=slurm)
    # requeued (by anyone): a restart and a new submit time; its run 1 has not written its own mark yet
    slurm.jobs[JOB].update(restart_cnt=1, submit_time=2000.0)
    job = read_job(slurm, sqlite_store, settings, JOB)
    assert job is not None and job.opted_in, job
