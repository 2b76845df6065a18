"""A node whose shards do not divide evenly over its GPUs, on a real Slurm cluster of its own (6 shards on 4 GPUs):
Slurm gives the last GPUs one shard more (store.slurm.shards_by_gpu), and fleetlens counts each job's share of its
own GPU by that GPU's shards, so what the jobs hold of each GPU adds up to exactly the GPU, and no GPU has a shard
free that Slurm would not give."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterator

import pytest
from sqlalchemy import select

from collector.importers.slurm import import_slurm
from enforcer.slurm_cycle import slurm_holdings
from store.models import Device, Placement
from store.models_slurm import SlurmJob as SlurmJobRow
from store.slurm import free_shards, parse_jobs, parse_nodes, shards_by_gpu
from tests.slurm.cluster import Cluster
from tests.slurm.conftest import started_cluster

pytestmark = pytest.mark.slurm

GPUS, SHARDS = 4, 6


@pytest.fixture(scope="module")
def uneven_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from started_cluster(tmp_path_factory, "slurm-uneven", shards=SHARDS)


def test_each_job_holds_its_share_of_its_own_gpu(uneven_cluster, sqlite_store, slurm_settings, tmp_path,
                                                  monkeypatch):
    slurm = uneven_cluster
    for key, value in slurm.env.items():
        monkeypatch.setenv(key, value)
    jobs = [slurm.submit("sleep 300", gres="shard:1", cwd=tmp_path, name=f"one-{i}") for i in range(SHARDS)]
    try:
        slurm.wait_running(*jobs)
        extra = slurm.submit("sleep 300", gres="shard:1", cwd=tmp_path, name="extra")
        result = import_slurm(sqlite_store, slurm_settings)
        assert result.errors == [] and result.nodes == 1

        # Slurm's own spread, read from where it put the jobs: one job on each of GPUs 0 and 1, two on 2 and 3
        _, now = parse_jobs(json.loads(slurm.run("squeue", "--json")))
        on_gpu = Counter(i for j in jobs for i in now[j].gpu_indices)
        assert tuple(on_gpu[i] for i in range(GPUS)) == shards_by_gpu(GPUS, SHARDS) == (1, 1, 2, 2)
        assert now[extra].state == "PENDING"  # every shard is taken, as Slurm sees it
        _, nodes = parse_nodes(json.loads(slurm.run("sinfo", "--json")))
        assert free_shards(nodes[slurm.node], now) == {0: 0, 1: 0, 2: 0, 3: 0}  # and as fleetlens sees it

        with sqlite_store.session() as s:
            index = {d.id: d.index for d in s.scalars(select(Device).where(Device.host_id == slurm.node))}
            held = [(index[p.device_id], p.compute_share) for p in s.scalars(
                select(Placement).where(Placement.state == "active", Placement.workflow_id.like("slurm-%")))]
            rows = {r.job_id: r for r in s.scalars(select(SlurmJobRow).where(SlurmJobRow.job_id.in_(jobs)))}
        assert sorted(share for i, share in held if i < 2) == [1.0, 1.0]  # GPU 0's one shard: all of it
        assert sorted(share for i, share in held if i >= 2) == [0.5] * 4  # one of GPU 2's two shards: half
        # a total against what was held: each GPU is held exactly once over, never twice
        total = Counter()
        for i, share in held:
            total[i] += share
        assert dict(total) == {i: 1.0 for i in range(GPUS)}
        assert all(rows[j].shards == 1 and len(rows[j].gpu_indices) == 1 for j in jobs)
        # the planner sizes moves by the finest GPU (two shards): a requeued job may land on any GPU of the node
        holdings = {h.job_id: h for h in slurm_holdings(sqlite_store, slurm_settings, now=time.time())}
        assert {holdings[j].shards_per_gpu for j in jobs} == {2}
    finally:
        slurm.cancel_all()
