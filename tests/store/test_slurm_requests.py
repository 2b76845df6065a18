"""What a job holds, however it asked for GPUs (--gres, --gpus, --gpus-per-task), whatever its GPUs' type is called
(MIG profiles start with a digit), and in every state in which Slurm leaves it its allocation."""

from __future__ import annotations

import pytest

from store.errors import InvalidInput
from store.slurm import Gres, SlurmNode, free_shards, gres_counts, parse_gres, parse_jobs, parse_nodes


def _squeue(*jobs: dict) -> dict:
    base = {"job_state": "RUNNING", "requeue": True, "submit_time": 1000, "restart_cnt": 0, "batch_host": "n1",
            "tres_per_node": "", "tres_per_job": "", "tres_per_task": ""}
    return {"meta": {"plugin": {"type": "openapi/v0.0.38"}, "Slurm": {"release": "22.05.8"}}, "errors": [],
            "jobs": [{**base, **j} for j in jobs]}


NODE = SlurmNode(name="n1", state="mixed", partitions=("gpu",), gpus=4, shards=8)


def test_gpu_types_named_like_mig_profiles_are_read_and_a_bare_number_is_a_count():
    assert gres_counts("gpu:1g.5gb:7,gpu:a100:1,shard:8", "node n1's gres") == (8, 8)
    assert parse_gres("gres:gpu:1g.5gb:1") == Gres(kind="gpu", count=1, type="1g.5gb")
    assert parse_gres("gpu:3g.20gb") == Gres(kind="gpu", count=1, type="3g.20gb")
    assert parse_gres("gpu:4") == Gres(kind="gpu", count=4)
    assert parse_gres("gpu:a100:2") == Gres(kind="gpu", count=2, type="a100")
    with pytest.raises(InvalidInput):
        parse_gres("gpu:a100:two")


def test_a_job_that_asked_with_gpus_or_gpus_per_task_holds_its_gpus():
    _, jobs = parse_jobs(_squeue(
        {"job_id": 1, "tres_per_job": "gres:gpu:1", "gres_detail": ["gpu:1(IDX:1)"]},  # --gpus=1
        {"job_id": 2, "tres_per_task": "gres:gpu:1", "gres_detail": ["gpu:1(IDX:2)"]},  # --gpus-per-task=1
        {"job_id": 3, "tres_per_node": "gres:shard:2", "gres_detail": ["shard:2(IDX:0)"]},  # --gres=shard:2
    ))
    assert [(jobs[j].gres.kind, jobs[j].gpu_indices) for j in (1, 2, 3)] == [("gpu", (1,)), ("gpu", (2,)),
                                                                           ("shard", (0,))]
    assert not jobs[1].opted_in and not jobs[2].opted_in
    # GPUs 1 and 2 are held whole: no shard there is free to move a job onto
    assert free_shards(NODE, jobs) == {0: 0, 3: 2}


@pytest.mark.parametrize("state", ["STOPPED", "SIGNALING", "RESIZING", "STAGE_OUT", "SUSPENDED", "COMPLETING"])
def test_a_job_in_a_flag_state_keeps_its_allocation(state):
    _, jobs = parse_jobs(_squeue({"job_id": 1, "job_state": state, "tres_per_node": "gres:shard:2",
                                  "gres_detail": ["shard:2(IDX:0)"]},
                                 {"job_id": 2, "job_state": state, "tres_per_node": "gres:gpu:1",
                                  "gres_detail": ["gpu:1(IDX:3)"]}))
    assert free_shards(NODE, jobs) == {0: 0, 1: 2, 2: 2}


def test_a_finished_or_requeued_job_holds_nothing():
    _, jobs = parse_jobs(_squeue(*({"job_id": i, "job_state": s, "tres_per_node": "gres:gpu:1",
                                    "gres_detail": ["gpu:1(IDX:0)"]}
                                   for i, s in enumerate(["COMPLETED", "FAILED", "REQUEUED", "REQUEUE_HOLD"]))))
    assert free_shards(NODE, jobs) == {0: 2, 1: 2, 2: 2, 3: 2}


def test_a_node_s_gres_with_its_gpus_socket_list_is_read():
    """sinfo names the sockets a node's GPUs are bound to: a range, or a list whose commas are not the gres's."""
    assert gres_counts("gpu:a100:4(S:0-1),shard:8", "node n1's gres") == (4, 8)
    assert gres_counts("gpu:a100:4(S:0,2),shard:8", "node n1's gres") == (4, 8)
    assert gres_counts("gpu:a100:2(S:0,2),gpu:v100:2(S:1,3),shard:8(S:0-3)", "node n1's gres") == (4, 8)
    with pytest.raises(InvalidInput, match="n1's gres"):
        gres_counts("gpu:4(S:0,2", "node n1's gres")


def test_a_node_whose_gres_cannot_be_read_is_left_out_alone_with_the_reason():
    meta = {"plugin": {"type": "openapi/v0.0.38"}, "Slurm": {"release": "22.05.8"}}
    errors: list[str] = []
    _, nodes = parse_nodes({"meta": meta, "errors": [], "nodes": [
        {"name": "ok01", "gres": "gpu:4(S:0,2),shard:8"}, {"name": "odd01", "gres": "gpu:4(S:0,2"}]}, errors=errors)
    assert list(nodes) == ["ok01"] and (nodes["ok01"].gpus, nodes["ok01"].shards) == (4, 8)
    assert len(errors) == 1 and "odd01" in errors[0] and "gpu:4(S:0,2" in errors[0]
