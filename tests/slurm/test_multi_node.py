"""A job on two nodes in the store (no cluster: the real one has one node, so squeue's JSON of a two-node job is
built here in Slurm 22.05's shape, and recorded through the importer's own `record_view`): it is placed on each
node's own GPUs, its workflow and its row count all of them, it is never movable, a node of it where its GPUs sit
idle is a finding even when its batch script's node runs its process, and the Fleet and Workflow pages count and
name every node's GPUs."""

from __future__ import annotations

from sqlalchemy import select

from analyzer.slurm_holders import RULE, find_slurm_holders_without_processes
from collector.importers.slurm import record_view
from store.models import Device, Finding, Placement, Process, Workflow
from store.models_slurm import SlurmJob
from store.registry import register_host
from store.settings import Settings
from store.slurm import SlurmView, parse_jobs, parse_nodes
from tests.ui.helpers import assert_clean, metrics, page, texts

META = {"plugin": {"type": "openapi/v0.0.38"}, "Slurm": {"release": "22.05.8"}}
NODES = {"meta": META, "errors": [], "nodes": [
    {"name": n, "state": "mixed", "partitions": ["gpu"], "gres": "gpu:4,shard:8"} for n in ("gpu01", "gpu02")]}


def _view(*jobs: dict) -> SlurmView:
    base = {"job_state": "RUNNING", "requeue": True, "submit_time": 1000, "restart_cnt": 0, "account": "ml",
            "tres_per_node": "", "tres_per_job": "", "tres_per_task": ""}
    version, parsed = parse_jobs({"meta": META, "errors": [], "jobs": [{**base, **j} for j in jobs]})
    _, nodes = parse_nodes(NODES)
    return SlurmView(version=version, nodes=nodes, jobs=parsed)


WIDE = {"job_id": 11, "name": "wide", "nodes": "gpu[01-02]", "batch_host": "gpu01", "tres_per_node": "gres:gpu:2",
        "comment": "fleetlens:movable", "gres_detail": ["gpu:2(IDX:0-1)", "gpu:2(IDX:2-3)"]}
SHARED = {"job_id": 12, "name": "shared", "nodes": "gpu[01-02]", "batch_host": "gpu01",
          "tres_per_node": "gres:shard:2", "gres_detail": ["shard:2(IDX:3)", "shard:2(IDX:0)"]}
# two jobs on one node sharing its GPU 2, a shard each
SOLO = [{"job_id": j, "name": f"solo{j}", "nodes": "gpu01", "batch_host": "gpu01", "tres_per_node": "gres:shard:1",
         "gres_detail": ["shard:1(IDX:2)"]} for j in (13, 14)]


def _active(store, workflow_id: str) -> list[tuple[str, int, float]]:
    with store.session() as s:
        return sorted(s.execute(select(Placement.host_id, Device.index, Placement.compute_share)
                                .join(Device, Device.id == Placement.device_id)
                                .where(Placement.workflow_id == workflow_id, Placement.state == "active")).tuples())


def test_a_two_node_job_is_placed_on_each_node_s_gpus_and_never_movable(any_store, tmp_path):
    settings = Settings(home=tmp_path)
    result = record_view(any_store, _view(WIDE, SHARED), settings, now=100.0)
    assert result.errors == [] and result.jobs == 2 and result.opted_in == 0
    assert _active(any_store, "slurm-11") == [("gpu01", 0, 1.0), ("gpu01", 1, 1.0), ("gpu02", 2, 1.0),
                                              ("gpu02", 3, 1.0)]
    # shard:2 per node, on one GPU of each: a GPU of two shards, whole, on both nodes
    assert _active(any_store, "slurm-12") == [("gpu01", 3, 1.0), ("gpu02", 0, 1.0)]
    with any_store.session() as s:
        wf, row = s.get(Workflow, "slurm-11"), s.get(SlurmJob, "slurm-11")
        assert wf.gpus == 4 and wf.labels["slurm_gpus"] == [["gpu01", [0, 1]], ["gpu02", [2, 3]]]
        assert (row.node, row.gpu_indices, row.gpus) == ("gpu01", [0, 1], 2)
        assert not row.opted_in and "2 nodes" in row.not_movable_reason
    # it ends: every node's placements end with it
    record_view(any_store, _view(SHARED), settings, now=200.0)
    assert _active(any_store, "slurm-11") == []
    with any_store.session() as s:
        assert s.get(Workflow, "slurm-11").labels["slurm_gpus"] == []


def test_a_node_of_a_job_with_no_process_there_is_a_finding(sqlite_store, tmp_path):
    now = 10_000.0
    with sqlite_store.session() as s:  # both nodes run an agent
        for node in ("gpu01", "gpu02"):
            register_host(s, node, hostname=node, source="nvml", now=now)
    record_view(sqlite_store, _view(WIDE), Settings(home=tmp_path), now=now - 1000)
    with sqlite_store.session() as s:  # the job's process runs on its batch script's node only
        s.add(Process(host_id="gpu01", pid=4242, start_time=now - 900, workflow_id="slurm-11", first_seen=now - 900,
                      last_seen=now))
    assert find_slurm_holders_without_processes(sqlite_store, now=now, grace_s=0) == 1
    with sqlite_store.session() as s:
        found = s.scalars(select(Finding).where(Finding.rule == RULE)).one()
    assert found.workflow_id == "slurm-11" and "GPU 2,3 of gpu02" in found.title and "gpu01" not in found.title
    assert found.evidence["idle_gpus_by_node"] == {"gpu02": [2, 3]} and found.gpu_hours_per_day == 48.0


def _row(store, workflow_id: str) -> tuple[str | None, list, list, str]:
    with store.session() as s:
        row = s.get(SlurmJob, workflow_id)
        return row.node, row.gpu_indices, row.gpus_by_node, row.state


def test_the_row_of_a_job_keeps_every_node_s_gpus_and_its_batch_node_s(any_store, tmp_path):
    settings = Settings(home=tmp_path)
    pending = {**WIDE, "job_id": 15, "job_state": "PENDING", "nodes": "", "batch_host": "", "gres_detail": []}
    record_view(any_store, _view(WIDE, SHARED, *SOLO, pending), settings, now=100.0)
    # gpus_by_node: every node's, sorted by node, as the workflow's label; node and gpu_indices: the batch node's
    assert _row(any_store, "slurm-11") == ("gpu01", [0, 1], [["gpu01", [0, 1]], ["gpu02", [2, 3]]], "RUNNING")
    assert _row(any_store, "slurm-12") == ("gpu01", [3], [["gpu01", [3]], ["gpu02", [0]]], "RUNNING")
    assert _row(any_store, "slurm-13") == ("gpu01", [2], [["gpu01", [2]]], "RUNNING")  # one node: its GPUs there
    assert _row(any_store, "slurm-15") == (None, [], [], "PENDING")
    with any_store.session() as s:
        for j in (11, 12, 13):
            assert s.get(SlurmJob, f"slurm-{j}").gpus_by_node == s.get(Workflow, f"slurm-{j}").labels["slurm_gpus"]
    # a job that ends holds nothing on any node; one that went back to pending holds nothing either
    record_view(any_store, _view(SHARED, *SOLO, {**WIDE, "job_id": 15}), settings, now=200.0)
    assert _row(any_store, "slurm-11") == ("gpu01", [], [], "GONE")
    assert _row(any_store, "slurm-15")[2] == [["gpu01", [0, 1]], ["gpu02", [2, 3]]]
    record_view(any_store, _view(SHARED, *SOLO, pending), settings, now=300.0)
    assert _row(any_store, "slurm-15") == (None, [], [], "PENDING")


def test_the_fleet_and_workflow_pages_count_and_name_every_node_of_a_job(cli_store, tmp_path):
    record_view(cli_store, _view(WIDE, SHARED, *SOLO), Settings(home=tmp_path), now=100.0)

    at = page("fleet")
    assert_clean(at)
    shown = metrics(at)
    # gpu01: 0, 1 (wide), 3 (shared), 2 (both solo jobs: once); gpu02: 2, 3 (wide), 0 (shared). The batch node's
    # alone would be 4.
    assert shown["GPUs held by Slurm jobs"] == "7"
    assert (shown["Slurm jobs running"], shown["Shards held"]) == ("4", "4")
    rows = next(df.value for df in at.dataframe if "gres" in df.value.columns).set_index("workflow_id")
    assert rows.loc["slurm-11", "nodes"] == "gpu01, gpu02"
    assert rows.loc["slurm-11", "gpus_held"] == "gpu01: 0,1; gpu02: 2,3"
    assert rows.loc["slurm-12", "gpus_held"] == "gpu01: 3; gpu02: 0"
    assert (rows.loc["slurm-13", "nodes"], rows.loc["slurm-13", "gpus_held"]) == ("gpu01", "2")  # one node: as before

    said = texts(page("workflow", workflow="slurm-11").markdown)
    assert "node gpu01, gpu02 · " in said and "holds GPU gpu01: 0,1; gpu02: 2,3 · " in said
    said = texts(page("workflow", workflow="slurm-13").markdown)
    assert "node gpu01 · " in said and "holds GPU 2 · " in said
