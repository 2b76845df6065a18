"""The finding "GPUs held with no process" gives a job its grace from the start of its current run (squeue's
start_time), not from its first import while it waited in the queue; and it counts a shard job's GPUs by its share of
each, as the import does."""

from __future__ import annotations

from sqlalchemy import select

from analyzer.slurm_holders import RULE, find_slurm_holders_without_processes
from collector.importers.slurm import import_slurm
from store.models import Finding
from store.registry import register_host
from store.settings import Settings
from tests.fakes.fake_slurm import SlurmAnswers

T0 = 1_000_000.0


def _job(state: str, gres: str = "gpu:1", **kw) -> dict:
    return {"job_id": 42, "job_state": state, "submit_time": T0, "tres_per_node": f"gres:{gres}", "requeue": True,
            "user_name": "u", "name": "train", **kw}


def _agent_on(store, node: str, now: float) -> None:
    """The node's agent wrote at `now` (and sees no process of the job)."""
    with store.session() as s:
        register_host(s, node, hostname=node, source="nvml", now=now)


def test_a_job_that_waited_in_the_queue_gets_its_grace_from_its_start(sqlite_store, tmp_path):
    settings, slurm = Settings(home=tmp_path), SlurmAnswers()
    slurm.jobs = [_job("PENDING")]
    import_slurm(sqlite_store, settings, cli=slurm, now=T0)  # its workflow is made while it waits, for an hour
    start = T0 + 3600
    slurm.jobs = [_job("RUNNING", start_time=int(start), nodes="n1", batch_host="n1", gres_detail=["gpu:1(IDX:0)"])]
    import_slurm(sqlite_store, settings, cli=slurm, now=start + 1)
    _agent_on(sqlite_store, "n1", start + 1)
    assert find_slurm_holders_without_processes(sqlite_store, now=start + 1, grace_s=300) == 0
    _agent_on(sqlite_store, "n1", start + 301)
    assert find_slurm_holders_without_processes(sqlite_store, now=start + 301, grace_s=300) == 1


def test_a_shard_job_s_idle_gpus_count_by_its_share_of_them(sqlite_store, tmp_path):
    settings, slurm = Settings(home=tmp_path), SlurmAnswers()  # n1: 4 GPUs, 8 shards, 2 on each
    slurm.jobs = [_job("RUNNING", "shard:1", start_time=int(T0), nodes="n1", batch_host="n1",
                       gres_detail=["shard:1(IDX:3)"])]
    import_slurm(sqlite_store, settings, cli=slurm, now=T0 + 1000)
    _agent_on(sqlite_store, "n1", T0 + 1000)
    assert find_slurm_holders_without_processes(sqlite_store, now=T0 + 1000, grace_s=300) == 1
    with sqlite_store.session() as s:
        found = s.scalars(select(Finding).where(Finding.rule == RULE)).one()
        assert found.gpu_hours_per_day == 12.0  # one shard of GPU 3's two: half of it, all day
