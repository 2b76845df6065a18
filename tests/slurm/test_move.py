"""The Slurm actuator's whole move against the real cluster: a real torch job on the SDK, opted in on shard:2, is
signalled, checkpoints (step, size, sha256 recorded), is requeued and held, changed to shard:1, released, and resumes
from that checkpoint under the same job id, on a GPU it now shares with another job. slurmctld is restarted while
the job is held: the move waits, then `fleetlens drive` carries it on to its end, as an operator would after an
interruption (one test, to keep the Slurm tests' time down)."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import select

import ui.cli
from collector.importers.slurm import import_slurm
from enforcer.actuators.base import Move, Step
from enforcer.actuators.slurm import SlurmActuator
from store.checkpoints import digest
from store.models import Action, ActionEvent, Checkpoint
from store.models_slurm import SlurmJob
from tests.slurm.cluster import job_processes, train_command

pytestmark = pytest.mark.slurm


def test_opted_in_job_moves_to_fewer_shards_and_resumes_from_its_checkpoint_through_a_slurmctld_restart(
        slurm, job_env, sqlite_store, slurm_settings, tmp_path, monkeypatch, capsys):
    # the mate takes one shard of GPU 0, so the mover's two shards are GPU 1's; on one shard it fits beside the mate
    mate = slurm.submit("sleep 300", gres="shard:1", env=job_env, cwd=tmp_path, name="mate")
    slurm.wait_running(mate)
    mover = slurm.submit(train_command(), gres="shard:2", comment="fleetlens:movable", env=job_env, cwd=tmp_path,
                         name="mover")
    slurm.wait_running(mover)
    assert slurm.job(mover)["gres_detail"] != slurm.job(mate)["gres_detail"]
    mate_gpu = slurm.job(mate)["gres_detail"]
    import_slurm(sqlite_store, slurm_settings)
    actuator = SlurmActuator(sqlite_store, slurm_settings)
    action_id = actuator.begin(Move(workflow_id=f"slurm-{mover}", to_device_id=0, request={"gres": "shard:1"},
                                    reason="idle on two shards"), now=time.time())
    while actuator.state(action_id) != "held":
        assert actuator.state(action_id) in ("planned", "signalled", "checkpointed"), actuator.state(action_id)
        actuator.advance(action_id, now=time.time())
        time.sleep(0.3)
    slurm.stop_ctld()
    try:  # slurmctld away (squeue gives up after about 9 s): the move waits where it is, nothing is done twice
        assert actuator.advance(action_id, now=time.time()) == []
        assert actuator.state(action_id) == "held"
    finally:
        slurm.start_ctld()
    # the rest through the CLI, on the same database: it finds the unfinished Slurm move and drives it to its end
    monkeypatch.setenv("FLEETLENS_DB_URL", str(sqlite_store.url))
    capsys.readouterr()
    assert ui.cli.run(["drive", "--timeout", "120"]) == 0
    shown = capsys.readouterr().out
    state = actuator.state(action_id)
    assert f"{action_id}" in shown and "resumed" in shown, shown

    with sqlite_store.session() as s:
        action = s.get(Action, action_id)
        events = [e.to_state for e in s.scalars(select(ActionEvent).where(ActionEvent.action_id == action_id)
                                                .order_by(ActionEvent.id))]
        ckpt = s.get(Checkpoint, action.checkpoint_id)
    assert state == "resumed", (action.error, events)
    assert events == ["planned", "signalled", "checkpointed", "held", "updated", "released", "resumed"]
    assert ckpt.step == action.checkpoint_step and ckpt.size_bytes > 0
    assert digest(ckpt.url) == (ckpt.sha256, ckpt.size_bytes)
    job = slurm.job(mover)
    assert job["job_state"] == "RUNNING" and job["tres_per_node"] == "gres:shard:1" and job["restart_cnt"] == 1
    assert action.detail["gpu_indices"] and f"IDX:{action.detail['gpu_indices'][0]}" in job["gres_detail"][0]
    assert mate_gpu[0].split("(")[1] == job["gres_detail"][0].split("(")[1]  # it shares the mate's GPU now
    assert len(job_processes(mover)) == 1  # one copy, under the same id
    import_slurm(sqlite_store, slurm_settings)
    with sqlite_store.session() as s:
        row = s.get(SlurmJob, f"slurm-{mover}")
        assert (row.gres, row.shards, row.restart_count) == ("shard:1", 1, 1)
    outcomes = [o.step for o in actuator.advance(action_id, now=0.0)]
    assert outcomes == [] and Step.RESUMED  # a finished action takes no more steps
