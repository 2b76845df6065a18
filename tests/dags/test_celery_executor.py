"""The analyze DAG on Airflow's Celery executor: Redis as the broker, PostgreSQL for Airflow's metadata, Celery's
results and the fleetlens store, a scheduler, a DAG processor, an API server and two Celery workers as real
processes. The traces fan out as mapped tasks over both workers; every trace ends analysed with its findings."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import func, select

from analyzer.traces import register_trace
from store.db import Store
from store.models import Finding, Trace
from tests.conftest import TRACES, pg_base_url
from tests.dags.celery_cluster import CeleryCluster

pytestmark = [pytest.mark.pg, pytest.mark.slow]

# every real trace here that has something to say (cpu_only_gloo_rank34 has no findings)
TRACE_FILES = ["a100_2rank_nccl.json.gz", "a100_80gb_16rank_rank0_training.json.gz",
               "a100_8rank_rank3_training.json.gz", "a100_alexnet_microbench.json.gz", "a100_triton_kernel.json.gz",
               "amd_mi250_minitoy.json.gz", "cpu_ops_no_gpu.json.gz", "sampled_128rank_rank0.json.gz",
               "sampled_128rank_rank1.json.gz"]
BATCH = 2
WORKERS = ("fleet-worker-1", "fleet-worker-2")


@pytest.fixture
def cluster(tmp_path: Path, pg_url: str) -> Iterator[CeleryCluster]:
    c = CeleryCluster(tmp_path, pg_base_url(), pg_url, {"FLEETLENS_ANALYZE_BATCH_SIZE": str(BATCH)})
    c.create()
    try:
        yield c
    finally:
        left = c.stop()
        c.drop()
        assert left == [], f"processes outlived their process groups: {left}"


def run_state(cluster: CeleryCluster, run_id: str) -> str | None:
    rows = cluster.query("SELECT state FROM dag_run WHERE dag_id = 'fleetlens_analyze' AND run_id = :r", r=run_id)
    return rows[0][0] if rows else None


def test_the_analyze_dag_fans_traces_out_over_two_celery_workers(cluster: CeleryCluster, pg_store: Store) -> None:
    ids = [register_trace(pg_store, TRACES / name, workflow_id=f"wf-{i}") for i, name in enumerate(TRACE_FILES)]

    cluster.start("api-server", "api-server", "--port", str(cluster.port), "--workers", "1")
    cluster.start("scheduler", "scheduler")
    cluster.start("dag-processor", "dag-processor")
    for name in WORKERS:
        cluster.start_worker(name)
    cluster.wait("the DAG processor to store fleetlens_analyze", lambda: bool(cluster.query(
        "SELECT 1 FROM serialized_dag WHERE dag_id = 'fleetlens_analyze'")), timeout=180)
    for name in WORKERS:
        cluster.wait(f"Celery worker {name}", lambda n=name: f"{n}@" in cluster.log(n) and " ready." in
                     cluster.log(n), timeout=180)

    run_id = "celery-test"
    cluster.airflow("dags", "trigger", "fleetlens_analyze", "--run-id", run_id)
    cluster.airflow("dags", "unpause", "fleetlens_analyze")
    cluster.wait("the triggered run to finish", lambda: run_state(cluster, run_id) in ("success", "failed"),
                 timeout=420)
    tis = cluster.query("SELECT task_id, map_index, state, hostname FROM task_instance "
                        "WHERE dag_id = 'fleetlens_analyze' AND run_id = :r ORDER BY task_id, map_index", r=run_id)
    assert run_state(cluster, run_id) == "success", f"{tis}\n{cluster.logs_tail()}"

    xcoms = {m: v for m, v in cluster.query(
        "SELECT map_index, value FROM xcom WHERE dag_id = 'fleetlens_analyze' AND run_id = :r "
        "AND task_id = 'analyze_traces' AND key = 'return_value'", r=run_id)}
    batches = [row for row in tis if row[0] == "analyze_traces"]
    assert len(batches) == -(-len(ids) // BATCH)  # one mapped task per batch
    analysed_by: dict[int, str] = {}
    for _, map_index, state, hostname in batches:
        result = xcoms[map_index] if isinstance(xcoms[map_index], dict) else json.loads(xcoms[map_index])
        assert state == "success" and result["failed"] == [], (map_index, result)
        for trace_id in result["analyzed"]:
            analysed_by[trace_id] = hostname
    assert sorted(analysed_by) == sorted(ids)
    assert set(analysed_by.values()) == set(WORKERS), analysed_by  # both workers took batches

    with pg_store.session() as s:
        assert {t.status for t in s.scalars(select(Trace))} == {"analyzed"}
        per_trace = dict(s.execute(select(Finding.trace_id, func.count()).group_by(Finding.trace_id)).all())
    assert all(per_trace.get(i, 0) > 0 for i in ids), per_trace
