"""The Slurm planner (pure): moves only jobs that opted in and hold more shards than they use, never on a guess; the
others get advice saying what they would need, a whole-GPU job the Slurm version."""

from __future__ import annotations

from enforcer.slurm_plan import SlurmHolding, needed_shards, plan_slurm_moves
from store.slurm import SlurmJob, SlurmNode, finest_shards, free_shards, opt_in, parse_gres, shards_by_gpu


def _h(wf: str, used: float | None, *, count: int = 2, kind: str = "shard", opted: bool = True,
       memory: tuple[int, int] | None = (2**30, 2**28), device_memory: int | None = None) -> SlurmHolding:
    return SlurmHolding(workflow_id=wf, job_id=int(wf.split("-")[1]), gres_kind=kind, count=count, shards_per_gpu=2,
                        used=used, opted_in=opted, not_movable_reason=None if opted else "did not opt in",
                        memory=memory, device_memory=device_memory)


def test_idle_opted_in_jobs_move_to_what_they_use():
    moves, advice, _ = plan_slurm_moves([_h("slurm-1", 0.05), _h("slurm-2", 0.9), _h("slurm-3", None),
                                         _h("slurm-4", 0.3, count=1)])
    assert [(m.workflow_id, m.request) for m in moves] == [("slurm-1", {"gres": "shard:1"})]
    assert moves[0].compute_share == 0.5 and advice == []
    assert needed_shards(0.5, 2) == 1 and needed_shards(0.51, 2) == 2 and needed_shards(0.0, 4) == 1


def test_lane_admission_decides_who_shares_a_gpu():
    # memory not known yet: it runs alone first; a lane of 1.05 (1.1 P + E) = 12.3 GiB needs both shards of 16 GiB
    moves, _, _ = plan_slurm_moves([_h("slurm-1", 0.05, memory=None),
                                    _h("slurm-2", 0.05, memory=(10 * 2**30, 2**29), device_memory=16 * 2**30),
                                    _h("slurm-3", 0.05, memory=(4 * 2**30, 2**29), device_memory=16 * 2**30)])
    assert [(m.workflow_id, m.request["gres"]) for m in moves] == [("slurm-3", "shard:1")]


def test_jobs_that_did_not_opt_in_or_hold_whole_gpus_get_advice_only():
    moves, advice, _ = plan_slurm_moves([_h("slurm-5", 0.1, opted=False), _h("slurm-6", 0.1, count=1, kind="gpu"),
                                         _h("slurm-7", 0.1)], busy=frozenset({"slurm-7"}))
    assert moves == []
    said = {a.workflow_id: a.message for a in advice}
    assert set(said) == {"slurm-5", "slurm-6"}
    assert "only advises: did not opt in" in said["slurm-5"] and "23.02.6" in said["slurm-6"]


def test_moves_are_capped_per_cycle_idlest_first():
    moves, _, _ = plan_slurm_moves([_h(f"slurm-{i}", 0.01 * i) for i in range(1, 6)], max_moves=2)
    assert [m.workflow_id for m in moves] == ["slurm-1", "slurm-2"]


def test_free_shards_leave_out_whole_gpus_and_count_the_leaving_job_as_free():
    node = SlurmNode(name="n", state="mixed", partitions=("p",), gpus=3, shards=6)

    def job(i: int, gres: str, idx: tuple[int, ...]) -> SlurmJob:
        g = parse_gres(gres)
        ok, why = opt_in("fleetlens:movable", True, g, None)
        return SlurmJob(job_id=i, name=None, user=None, account=None, partition="p", state="RUNNING", reason=None,
                        node="n", submit_time=1.0, time_limit_s=None, gres=g, gres_error=None, gpu_indices=idx,
                        requeue=True, restart_count=0, comment="fleetlens:movable", opted_in=ok,
                        not_movable_reason=why)

    jobs = {1: job(1, "shard:2", (0,)), 2: job(2, "gpu:1", (1,)), 3: job(3, "shard:1", (2,))}
    assert free_shards(node, jobs) == {0: 0, 2: 1}
    assert free_shards(node, jobs, leaving=1) == {0: 2, 2: 1}
    assert not jobs[2].opted_in and "23.02.6" in jobs[2].not_movable_reason
    # 7 shards on 3 GPUs are 2, 2, 3 (Slurm's spread): GPU 2 has one shard more free
    uneven = SlurmNode(name="n", state="mixed", partitions=("p",), gpus=3, shards=7)
    assert free_shards(uneven, jobs) == {0: 0, 2: 2} and free_shards(uneven, jobs, leaving=1) == {0: 2, 2: 2}


def test_shards_spread_over_gpus_as_slurm_spreads_them():
    # measured on Slurm 22.05 (tests/slurm/test_uneven_shards.py checks it on the real cluster): the remainder goes
    # to the last GPUs
    assert shards_by_gpu(4, 8) == (2, 2, 2, 2) and shards_by_gpu(4, 6) == (1, 1, 2, 2)
    assert shards_by_gpu(4, 3) == (0, 1, 1, 1) and shards_by_gpu(4, 0) == (0, 0, 0, 0) and shards_by_gpu(0, 8) == ()
    assert finest_shards(4, 6) == 2 and finest_shards(0, 0) == 0
    node = SlurmNode(name="n", state="mixed", partitions=("p",), gpus=4, shards=6)
    assert [node.shards_on(i) for i in range(5)] == [1, 1, 2, 2, 0] and node.finest_shards == 2
