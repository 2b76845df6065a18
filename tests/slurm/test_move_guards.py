"""The Slurm actuator's guards, against the real cluster: a requeuehold that Slurm applied but whose answer was lost
(slurmctld's "Unexpected message received") is found on the next step, held, and the move goes on to its end; a job
whose training runs as a child of its batch script (no `exec`) is recorded as not movable when imported, and one
whose start mark (come after the import) is an older SDK's that does not say is never signalled; and one step reads
the start mark of its own job only, though squeue 22.05 lists every job whatever `--jobs` says (checked here too)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from sqlalchemy import select

import store.slurm_marks
from collector.importers.slurm import import_slurm
from enforcer.actuators.base import Move
from enforcer.actuators.slurm import SlurmActuator
from store.errors import InvalidInput, UpstreamUnavailable
from store.models import Action, ActionEvent
from store.models_slurm import SlurmJob
from store.slurm_cli import SlurmCli
from store.slurm_marks import STARTED, Started, job_folder, read_manifest, read_started, write_mark
from tests.slurm.cluster import drive_to_end, job_processes, train_command

pytestmark = pytest.mark.slurm


@dataclass(frozen=True)
class AnswerLost(SlurmCli):
    """The real Slurm CLI, except that the first `scontrol requeuehold` is carried out and its answer then lost, as
    when slurmctld restarts right after applying it."""

    lost: list[str] = field(default_factory=list)

    def run(self, name: str, *args: str) -> str:
        out = super().run(name, *args)
        if name == "scontrol" and args[:1] == ("requeuehold",) and not self.lost:
            self.lost.append(args[1])
            raise UpstreamUnavailable(f"`scontrol {' '.join(args)}` could not reach slurmctld: Unexpected message "
                                      "received")
        return out


def _begin(store, settings, job_id: int, cli: SlurmCli | None = None) -> tuple[SlurmActuator, int]:
    import_slurm(store, settings)
    actuator = SlurmActuator(store, settings, cli=cli)
    return actuator, actuator.begin(Move(workflow_id=f"slurm-{job_id}", to_device_id=0, request={"gres": "shard:1"}),
                                    now=time.time())


def _log(store, action_id: int) -> list[tuple[str, str]]:
    with store.session() as s:
        return [(e.to_state, e.message) for e in s.scalars(
            select(ActionEvent).where(ActionEvent.action_id == action_id).order_by(ActionEvent.id))]


def _error(store, action_id: int) -> str:
    with store.session() as s:
        return s.get(Action, action_id).error or ""


def test_a_requeuehold_whose_answer_was_lost_is_carried_on_not_left_held(slurm, job_env, sqlite_store,
                                                                         slurm_settings, tmp_path):
    job = slurm.submit(train_command(), gres="shard:2", comment="fleetlens:movable", env=job_env, cwd=tmp_path)
    slurm.wait_running(job)
    cli = AnswerLost()
    actuator, action_id = _begin(sqlite_store, slurm_settings, job, cli=cli)
    state = drive_to_end(actuator, action_id, timeout_s=150)
    events = _log(sqlite_store, action_id)
    assert cli.lost == [str(job)]  # the hold was applied and its answer lost
    assert state == "resumed", events
    assert [s for s, _ in events] == ["planned", "signalled", "checkpointed", "held", "updated", "released",
                                      "resumed"]
    assert "answer to the requeuehold was lost" in dict(events)["held"]
    now = slurm.job(job)  # released with its new request, once, under its id: not held forever
    assert (now["job_state"], now["tres_per_node"], now["restart_cnt"]) == ("RUNNING", "gres:shard:1", 1)
    assert len(job_processes(job)) == 1


def test_a_job_that_runs_its_training_without_exec_is_never_signalled(slurm, job_env, sqlite_store, slurm_settings,
                                                                      tmp_path):
    job = slurm.submit(train_command().removeprefix("exec "), gres="shard:2", comment="fleetlens:movable",
                       env=job_env, cwd=tmp_path)
    slurm.wait_running(job)
    folder = job_folder(slurm_settings, f"slurm-{job}")
    slurm.wait(lambda: read_started(folder), timeout=90)
    assert read_started(folder).batch_step is False  # its parent is the batch script, not slurmstepd
    # the import reads its mark: observed and advised only, so no cycle plans a move the actuator must refuse
    with pytest.raises(InvalidInput, match="observed and advised only.*without `exec`.*exec python train.py"):
        _begin(sqlite_store, slurm_settings, job)
    with sqlite_store.session() as s:
        assert not s.get(SlurmJob, f"slurm-{job}").opted_in
    time.sleep(2)  # had USR1 been sent, the batch script would be dead by now (WTERMSIG 10)
    now = slurm.job(job)
    assert (now["job_state"], now["restart_cnt"], now["tres_per_node"]) == ("RUNNING", 0, "gres:shard:2")
    assert read_manifest(folder) is None and len(job_processes(job)) == 1


def _old_mark(folder: str, job_id: int) -> None:
    """A start mark as an SDK from before `batch_step` writes it."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / STARTED).write_text(json.dumps({
        "job_id": job_id, "restart_count": 0, "step": 0, "gpus": "0", "started_at": time.time(),
        "restored_sha256": None, "movable": False, "memory_fraction": None, "memory_note": None}))


def test_a_start_mark_of_an_sdk_that_does_not_say_is_refused(slurm, sqlite_store, slurm_settings, tmp_path):
    job = slurm.submit("sleep 300", gres="shard:2", comment="fleetlens:movable", cwd=tmp_path, name="old-sdk")
    slurm.wait_running(job)
    actuator, action_id = _begin(sqlite_store, slurm_settings, job)  # no mark when imported: movable by its comment
    _old_mark(job_folder(slurm_settings, f"slurm-{job}"), job)  # the mark the actuator reads before it signals
    state = drive_to_end(actuator, action_id, timeout_s=30)
    time.sleep(2)  # a signalled `sleep` batch script dies of USR1
    now = slurm.job(job)
    assert (now["job_state"], now["restart_cnt"]) == ("RUNNING", 0)
    assert state == "failed"
    error = _error(sqlite_store, action_id)
    assert "does not say whether" in error and "exec" in error and "nothing was done" in error


def test_a_step_reads_the_start_mark_of_its_own_job_only(slurm, sqlite_store, slurm_settings, tmp_path, monkeypatch):
    others = [slurm.submit("sleep 300", cwd=tmp_path, name=f"other{i}") for i in range(3)]
    asks = slurm.submit("sleep 300", gres="shard:2", cwd=tmp_path, name="asks")  # opts in through its start mark
    slurm.wait_running(asks, *others)
    folder = job_folder(slurm_settings, f"slurm-{asks}")
    # its SDK's mark asks to be movable, but of a run Slurm has not started yet: the move waits for the current one
    write_mark(folder, STARTED, Started(job_id=asks, restart_count=1, step=0, gpus="0", started_at=time.time(),
                                        movable=True, batch_step=True))
    actuator, action_id = _begin(sqlite_store, slurm_settings, asks)
    reads: list[str] = []
    real = store.slurm_marks.read_started
    monkeypatch.setattr(store.slurm_marks, "read_started", lambda f: reads.append(f) or real(f))
    for _ in range(3):
        assert actuator.advance(action_id, now=time.time()) == [] and actuator.state(action_id) == "planned"
    # squeue listed every job each time; the opt-in was read from the moving job's own mark, once per step
    listed = {j["job_id"] for j in actuator.cli.json("squeue", f"--jobs={asks}")["jobs"]}
    assert listed >= {asks, *others} and reads == [folder] * 3
