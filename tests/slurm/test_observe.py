"""Slurm's view in the store, from the real cluster: jobs as workflows `slurm-<id>` with their team, time limit,
request and GPUs; nodes as hosts with their GPUs; and opt-in read from each job, never more. A job that did not opt
in is never signalled, held or changed, whatever the planner and the actuator are asked to do."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import select

from collector.importers.slurm import import_slurm
from enforcer.actuators.base import Move
from enforcer.actuators.slurm import SlurmActuator
from enforcer.cycle import run_cycle
from store.errors import InvalidInput
from store.models import Action, Device, Host, Placement, ProcessSample, Workflow
from store.models_slurm import SlurmJob as SlurmJobRow

pytestmark = pytest.mark.slurm

# a batch script that records every signal it gets: a job fleetlens must never touch proves it was not touched
TRAP = "trap 'echo USR1 >> {marks}/$SLURM_JOB_ID' USR1; while true; do sleep 0.2; done"


def test_jobs_nodes_and_opt_in_come_into_the_store(slurm, sqlite_store, slurm_settings, tmp_path):
    script = TRAP.format(marks=tmp_path)
    movable = slurm.submit(script, gres="shard:2", comment="fleetlens:movable", account="ml-research",
                           time_limit="10", cwd=tmp_path, name="movable")
    plain = slurm.submit(script, gres="shard:2", account="vision", cwd=tmp_path, name="plain")
    whole = slurm.submit(script, gres="gpu:1", comment="fleetlens:movable", cwd=tmp_path, name="whole")
    no_requeue = slurm.submit(script, gres="shard:1", comment="fleetlens:movable", requeue=False, cwd=tmp_path,
                              name="no-requeue")
    slurm.wait_running(movable, plain, whole, no_requeue)
    settings = slurm_settings.model_copy(update={"slurm_teams": {"ml-research": "research"}})
    result = import_slurm(sqlite_store, settings)
    # squeue also lists the jobs earlier tests ended (for Slurm's MinJobAge): only this test's four are looked at
    assert (result.version, result.nodes, result.errors) == ("22.05.8", 1, []) and result.jobs >= 4

    with sqlite_store.session() as s:
        rows = {r.job_id: r for r in s.scalars(select(SlurmJobRow))}
        assert [j for j in (movable, plain, whole, no_requeue) if rows[j].opted_in] == [movable]
        wfs = {w.id: w for w in s.scalars(select(Workflow))}
        host = s.get(Host, slurm.node)
        devices = {d.index: d.id for d in s.scalars(select(Device).where(Device.host_id == slurm.node))}
        placements = {(p.workflow_id, p.device_id): p.compute_share
                      for p in s.scalars(select(Placement).where(Placement.state == "active"))}
    assert host.labels["slurm"]["gpus"] == 4 and host.labels["slurm"]["shards"] == 8 and sorted(devices) == [0, 1, 2, 3]
    m = rows[movable]
    assert (m.gres, m.shards, m.time_limit_s, m.account, m.opted_in, m.state) == ("shard:2", 2, 600.0, "ml-research",
                                                                               True, "RUNNING")
    assert wfs[f"slurm-{movable}"].team == "research" and wfs[f"slurm-{movable}"].id_source == "slurm"
    assert wfs[f"slurm-{plain}"].team == "vision"  # not renamed: the account itself
    assert wfs[f"slurm-{whole}"].team == "debug"  # no account: the partition
    assert placements[(f"slurm-{movable}", devices[m.gpu_indices[0]])] == 1.0  # two shards of two: the whole GPU
    assert placements[(f"slurm-{no_requeue}", devices[rows[no_requeue].gpu_indices[0]])] == 0.5
    assert not rows[plain].opted_in and "did not opt in" in rows[plain].not_movable_reason
    assert not rows[whole].opted_in and "23.02.6" in rows[whole].not_movable_reason and rows[whole].gpus == 1
    assert not rows[no_requeue].opted_in and "--no-requeue" in rows[no_requeue].not_movable_reason
    assert not any(w.managed or w.movable for w in wfs.values())  # the agents' migration never takes them

    # every job uses nothing: the plan moves the one that opted in and advises the others, never touching them
    now = time.time()
    with sqlite_store.session() as s:  # memory seen in enough samples (admission's rule) to share a GPU
        for j in (movable, plain, whole, no_requeue):
            for k in range(settings.memory_seen_steps):
                s.add(ProcessSample(device_id=0, workflow_id=f"slurm-{j}", host_id=slurm.node, pid=j,
                                    ts=now - 5 - k * 0.1, cpu_util=0.02, mem_used=2**20))
    actuator = SlurmActuator(sqlite_store, settings)
    # the whole enforcement cycle, twice: its Slurm part begins the move; the cycle's driver hands it to the Slurm
    # actuator (the agents' state machine, which would fail it, never takes it up), and that waits for the job's SDK
    enforcing = settings.model_copy(update={"slurm": True, "enforce": True, "enforce_drive_s": 0.0})
    cycle = run_cycle(sqlite_store, enforcing, now=now)["slurm"]
    assert cycle["moves"] == [f"slurm-{movable}"] and len(cycle["begun"]) == 1
    again = run_cycle(sqlite_store, enforcing, now=now + 1)
    assert again["slurm"]["begun"] == [] and again["driven"].get(str(cycle["begun"][0]), "planned") == "planned"
    with sqlite_store.session() as s:  # waiting for the job's SDK, which this script has not: nothing sent yet
        begun = s.get(Action, cycle["begun"][0])
        assert (begun.engine, begun.state) == ("slurm", "planned")
    assert set(cycle["advice"]) == {f"slurm-{plain}", f"slurm-{whole}"}  # no_requeue has one shard: nothing to give
    assert "did not opt in" in cycle["advice"][f"slurm-{plain}"]
    assert "23.02.6" in cycle["advice"][f"slurm-{whole}"]
    for j in (plain, whole, no_requeue):  # begun by hand, the actuator refuses them and writes nothing
        with pytest.raises(InvalidInput, match="observed and advised only"):
            actuator.begin(Move(workflow_id=f"slurm-{j}", to_device_id=0, request={"gres": "shard:1"}), now=now)
    # an action someone wrote into the store for a job that did not opt in: the actuator checks Slurm again, refuses
    with sqlite_store.session() as s:
        forged = Action(kind="migrate", workflow_id=f"slurm-{plain}", state="planned", attempts=0, created_at=now,
                        updated_at=now, engine="slurm", detail={"job_id": plain, "node": slurm.node,
                                                                 "old_gres": "shard:1", "new_gres": "shard:1",
                                                                 "restart_before": 0, "attempts": 0})
        s.add(forged)
        s.flush()
        forged_id = forged.id
    actuator.advance(forged_id, now=now)
    with sqlite_store.session() as s:
        assert s.get(Action, forged_id).state == "failed"
        assert "no longer opts in" in s.get(Action, forged_id).error
    time.sleep(1.0)  # a signal, had one been sent, reaches the trap within this
    jobs = slurm.jobs()
    for j in (plain, whole, no_requeue):
        assert jobs[j]["job_state"] == "RUNNING" and jobs[j]["restart_cnt"] == 0
        assert jobs[j]["tres_per_node"] == {plain: "gres:shard:2", whole: "gres:gpu:1", no_requeue: "gres:shard:1"}[j]
        assert not (tmp_path / str(j)).exists(), f"job {j} was signalled"
    assert all(not (tmp_path / str(j)).exists() for j in (movable,))  # its SDK never said it was ready: no signal
