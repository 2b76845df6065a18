"""A job on several nodes, as squeue --json (Slurm 22.05) gives it: `nodes` is its node list (a host list), and
`gres_detail` has one entry per node of that list, in its order, each with that node's own GPU indices. Each node's
GPUs are the job's there; the free shards of every node count them; such a job is never movable. Host lists with
several bracket groups in one name expand to every combination."""

from __future__ import annotations

import pytest

from store.errors import InvalidInput
from store.slurm import OPT_IN_WORD, SlurmNode, expand_hostlist, free_shards, held_by_node, parse_jobs


def _squeue(*jobs: dict) -> dict:
    base = {"job_state": "RUNNING", "requeue": True, "submit_time": 1000, "restart_cnt": 0,
            "tres_per_node": "", "tres_per_job": "", "tres_per_task": ""}
    return {"meta": {"plugin": {"type": "openapi/v0.0.38"}, "Slurm": {"release": "22.05.8"}}, "errors": [],
            "jobs": [{**base, **j} for j in jobs]}


def _node(name: str) -> SlurmNode:
    return SlurmNode(name=name, state="mixed", partitions=("gpu",), gpus=4, shards=8)


TWO_NODES = {"job_id": 1, "nodes": "gpu[01-02]", "batch_host": "gpu01", "tres_per_node": "gres:gpu:2",
             "gres_detail": ["gpu:2(IDX:0-1)", "gpu:2(IDX:2-3)"]}


def test_a_job_on_two_nodes_holds_each_node_s_own_gpus():
    _, jobs = parse_jobs(_squeue(
        TWO_NODES,
        {"job_id": 2, "nodes": "gpu02", "batch_host": "gpu02", "tres_per_node": "gres:shard:2",
         "gres_detail": ["shard:2(IDX:0)"]}))
    job = jobs[1]
    assert job.nodes == ("gpu01", "gpu02")
    assert job.gpus_by_node == {"gpu01": (0, 1), "gpu02": (2, 3)}
    assert (job.node, job.gpu_indices, job.gpus_held) == ("gpu01", (0, 1), 4)  # the batch host's, and all of them
    assert job.gpus_on("gpu02") == (2, 3) and job.gpus_on("gpu03") == ()
    # gpu01's GPUs 0 and 1 are held whole; on gpu02 its GPUs 2 and 3 are too, beside job 2's two shards of GPU 0
    assert free_shards(_node("gpu01"), jobs) == {2: 2, 3: 2}
    assert free_shards(_node("gpu02"), jobs) == {0: 0, 1: 2}
    assert free_shards(_node("gpu02"), jobs, leaving=1) == {0: 0, 1: 2, 2: 2, 3: 2}
    single = jobs[2]  # a job on one node reads as before
    assert (single.node, single.nodes, single.gpu_indices, single.gpus_by_node) == (
        "gpu02", ("gpu02",), (0,), {"gpu02": (0,)})


def test_a_job_on_several_nodes_is_never_movable_and_says_why():
    _, jobs = parse_jobs(_squeue({**TWO_NODES, "tres_per_node": "gres:shard:2", "comment": OPT_IN_WORD,
                                  "gres_detail": ["shard:2(IDX:0)", "shard:2(IDX:1)"]}))
    job = jobs[1]
    assert not job.opted_in
    assert "by its --comment" in job.not_movable_reason and "2 nodes" in job.not_movable_reason
    assert free_shards(_node("gpu02"), jobs) == {0: 2, 1: 0, 2: 2, 3: 2}


def test_a_node_of_the_job_without_gpus_and_details_that_do_not_match_the_nodes():
    # Slurm leaves the entry of a node where the job holds no GPU empty (null in the JSON)
    assert held_by_node(["a", "b", "c"], ["gpu:1(IDX:3)", None, ""]) == {"a": (3,)}
    assert held_by_node(["a"], []) == {}
    _, jobs = parse_jobs(_squeue({**TWO_NODES, "gres_detail": ["gpu:2(IDX:0-1)"]}))
    job = jobs[1]  # which node holds GPUs 0-1 cannot be told: observed without GPUs, never guessed
    assert job.gres_error and "1 entries for the job's 2 node(s)" in job.gres_error
    assert job.gpus_by_node == {} and job.gpu_indices == ()
    _, jobs = parse_jobs(_squeue({**TWO_NODES, "nodes": "gpu[01-"}))
    assert "host list" in jobs[1].gres_error and not jobs[1].opted_in


def test_a_pending_job_holds_nothing_on_no_node():
    _, jobs = parse_jobs(_squeue({**TWO_NODES, "job_state": "PENDING", "nodes": "", "batch_host": "",
                                  "gres_detail": []}))
    assert (jobs[1].node, jobs[1].nodes, jobs[1].gpus_by_node) == (None, (), {})


def test_host_lists_with_several_bracket_groups_expand_to_every_combination():
    assert expand_hostlist("rack[1-2]-n[01-02]") == ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]
    assert expand_hostlist("n[01-03,07],gpu5") == ["n01", "n02", "n03", "n07", "gpu5"]
    assert expand_hostlist("r[1,3]n[8-9]x,solo") == ["r1n8x", "r1n9x", "r3n8x", "r3n9x", "solo"]
    assert expand_hostlist("") == []


@pytest.mark.parametrize("bad", ["n[1-2", "n1]", "n[a-b]", "n[[1]]", "n[3-1]"])
def test_a_host_list_it_cannot_read_is_refused(bad: str):
    with pytest.raises(InvalidInput, match="host list"):
        expand_hostlist(bad)
