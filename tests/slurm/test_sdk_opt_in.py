"""Opting in through the fleetlens SDK, against the real cluster: a real torch job submitted without the opt-in
comment, whose SDK asks to be movable (FLEETLENS_MOVABLE=true), is imported as opted in and moved to fewer shards,
staying opted in across its requeue; a job on the same SDK that does not ask is observed and advised only, never
signalled, held or changed. Each job's start mark shows the memory cap its SDK computed from its shards."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import select

from collector.importers.slurm import import_slurm
from enforcer.actuators.slurm import SlurmActuator
from enforcer.slurm_cycle import run_slurm_cycle
from store.models import ActionEvent, ProcessSample
from store.models_slurm import SlurmJob as SlurmJobRow
from store.slurm_marks import job_folder, read_manifest, read_started
from tests.slurm.cluster import drive_to_end, job_processes, train_command

pytestmark = pytest.mark.slurm


def test_a_job_whose_sdk_asks_is_moved_without_the_comment_and_one_whose_sdk_does_not_is_never_touched(
        slurm, job_env, sqlite_store, slurm_settings, tmp_path):
    asks = slurm.submit(train_command(), gres="shard:2", env={**job_env, "FLEETLENS_MOVABLE": "true"}, cwd=tmp_path,
                        name="sdk-asks")
    quiet = slurm.submit(train_command(), gres="shard:2", env=job_env, cwd=tmp_path, name="sdk-quiet")
    slurm.wait_running(asks, quiet)
    folders = {j: job_folder(slurm_settings, f"slurm-{j}") for j in (asks, quiet)}
    started = {j: slurm.wait(lambda f=f: read_started(f), timeout=90) for j, f in folders.items()}
    assert (started[asks].movable, started[quiet].movable) == (True, False)
    # two shards of a GPU split in two (slurm.conf: gpu:4,shard:8): the whole GPU, so nothing to cap
    assert started[asks].memory_fraction == started[quiet].memory_fraction == 1.0
    assert "2 shard(s) on 1 GPU(s) of 2" in started[asks].memory_note

    import_slurm(sqlite_store, slurm_settings)
    with sqlite_store.session() as s:
        rows = {r.job_id: r for r in s.scalars(select(SlurmJobRow).where(SlurmJobRow.job_id.in_((asks, quiet))))}
    assert (rows[asks].opted_in, rows[asks].comment, rows[asks].not_movable_reason) == (True, None, None)
    assert not rows[quiet].opted_in and "did not opt in" in rows[quiet].not_movable_reason
    assert "FLEETLENS_MOVABLE" in rows[quiet].not_movable_reason

    now = time.time()
    with sqlite_store.session() as s:  # both idle, their memory seen in enough samples (admission's rule) to share
        for j in (asks, quiet):
            for k in range(slurm_settings.memory_seen_steps):
                s.add(ProcessSample(device_id=0, workflow_id=f"slurm-{j}", host_id=slurm.node, pid=j,
                                    ts=now - 5 - k * 0.1, cpu_util=0.02, mem_used=2**20))
    actuator = SlurmActuator(sqlite_store, slurm_settings)
    cycle = run_slurm_cycle(sqlite_store, slurm_settings, apply=True, now=now, actuator=actuator)
    assert cycle["moves"] == [f"slurm-{asks}"] and len(cycle["begun"]) == 1 and cycle["errors"] == []
    assert set(cycle["advice"]) == {f"slurm-{quiet}"} and "FLEETLENS_MOVABLE" in cycle["advice"][f"slurm-{quiet}"]
    # the actuator decides the opt-in again from Slurm and the job's mark before it signals, and carries the move out
    state = drive_to_end(actuator, cycle["begun"][0], timeout_s=150)
    with sqlite_store.session() as s:
        events = [(e.to_state, e.message) for e in s.scalars(select(ActionEvent).where(
            ActionEvent.action_id == cycle["begun"][0]).order_by(ActionEvent.id))]
    assert state == "resumed", events

    job = slurm.job(asks)
    assert job["job_state"] == "RUNNING" and job["tres_per_node"] == "gres:shard:1" and job["restart_cnt"] == 1
    again = read_started(folders[asks])
    assert (again.restart_count, again.movable, again.memory_fraction) == (1, True, 0.5)  # one shard of two now
    assert "not enforced" in again.memory_note  # fake GPUs: torch sees no CUDA, so the cap is reported only
    import_slurm(sqlite_store, slurm_settings)  # requeued (a new submit time), its SDK's ask still counts
    with sqlite_store.session() as s:
        assert s.get(SlurmJobRow, f"slurm-{asks}").opted_in

    other = slurm.job(quiet)  # never signalled (no checkpoint), held, requeued or changed
    assert (other["job_state"], other["restart_cnt"], other["tres_per_node"]) == ("RUNNING", 0, "gres:shard:2")
    assert read_manifest(folders[quiet]) is None and read_started(folders[quiet]).restart_count == 0
    assert len(job_processes(quiet)) == 1 and len(job_processes(asks)) == 1
