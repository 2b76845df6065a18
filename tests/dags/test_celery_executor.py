"""The analyze DAG on Airflow's Celery executor: Redis as the broker, PostgreSQL for Airflow's metadata, Celery's
results and the fleetlens store, a scheduler, a DAG processor, an API server and two Celery workers as real
processes, started once. In one run the traces fan out as mapped tasks over both workers, and a worker killed in the
middle of a trace has its batch retried on the other: every trace ends analysed with its findings, none twice."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import func, select

from analyzer.traces import analyze_one, register_trace
from store.db import Store
from store.models import Finding, Trace
from tests.conftest import TRACES, pg_base_url
from tests.dags.celery_cluster import CeleryCluster

pytestmark = [pytest.mark.pg, pytest.mark.slow]

# every real trace here that has something to say (cpu_only_gloo_rank34 has no findings), registered in this order
# and so batched in it (oldest first): two fast batches the two workers take first, then batches that each open with
# a slow trace (seconds of analysis), in which the kill lands once a worker has finished a batch of the run
BATCH = 2
SLOW = {"a100_80gb_16rank_rank0_training.json.gz", "a100_8rank_rank3_training.json.gz", "a100_2rank_nccl.json.gz"}
TRACE_FILES = ["a100_alexnet_microbench.json.gz", "a100_triton_kernel.json.gz",
               "amd_mi250_minitoy.json.gz", "cpu_ops_no_gpu.json.gz",
               "a100_80gb_16rank_rank0_training.json.gz", "sampled_128rank_rank0.json.gz",
               "a100_8rank_rank3_training.json.gz", "sampled_128rank_rank1.json.gz",
               "a100_2rank_nccl.json.gz"]
WORKERS = ("fleet-worker-1", "fleet-worker-2")
RUN_ID = "celery-test"


@pytest.fixture
def cluster(tmp_path: Path, pg_url: str) -> Iterator[CeleryCluster]:
    """The whole deployment, started (the analyze DAG stored, both workers ready, no run yet), with the fleetlens
    store at `pg_url` and batches of BATCH traces; stopped (and checked for leftovers by environment) after the test,
    pass or fail."""
    # a killed worker's claim on its trace lapses 20 s after its last renewal (120 s by default): its retry
    # retakes the trace soon after the scheduler has found the worker gone
    c = CeleryCluster(tmp_path, pg_base_url(), pg_url, {"FLEETLENS_ANALYZE_BATCH_SIZE": str(BATCH),
                                                         "FLEETLENS_TRACE_CLAIM_TIMEOUT_S": "20"})
    try:
        c.create()
        c.start("api-server", "api-server", "--port", str(c.port), "--workers", "1")
        c.start("scheduler", "scheduler")
        c.start("dag-processor", "dag-processor")
        for name in WORKERS:
            c.start_worker(name)
        c.wait("the DAG processor to store fleetlens_analyze", lambda: bool(c.query(
            "SELECT 1 FROM serialized_dag WHERE dag_id = 'fleetlens_analyze'")), timeout=180)
        for name in WORKERS:
            c.wait(f"Celery worker {name}", lambda n=name: f"{n}@" in c.log(n) and " ready." in c.log(n),
                   timeout=180)
        yield c
    finally:
        left = c.stop()
        c.drop()
        assert left == [], f"processes outlived their process groups: {left}"


def run_state(cluster: CeleryCluster) -> str | None:
    rows = cluster.query("SELECT state FROM dag_run WHERE dag_id = 'fleetlens_analyze' AND run_id = :r", r=RUN_ID)
    return rows[0][0] if rows else None


def mapped(cluster: CeleryCluster) -> list[tuple]:
    """(map_index, state, try_number, hostname) of each analyze_traces instance of the run."""
    return cluster.query("SELECT map_index, state, try_number, hostname FROM task_instance WHERE dag_id = "
                         "'fleetlens_analyze' AND run_id = :r AND task_id = 'analyze_traces' ORDER BY map_index",
                         r=RUN_ID)


def kill_mid_trace(cluster: CeleryCluster, store: Store, ids: list[int]) -> dict[str, int | str]:
    """Kill a worker that has already finished a batch of the run, while the first trace of the batch it runs now, a
    slow one (the kill lands well before its end), is being analysed (so the retry owes the whole batch); returns the
    victim trace, worker and map index."""
    deadline = time.monotonic() + 300
    while True:
        assert time.monotonic() < deadline and run_state(cluster) != "success", \
            f"no trace was seen mid-analysis on a worker that had finished a batch\n{mapped(cluster)}\n" + \
            cluster.logs_tail()
        with store.session() as s:
            busy = set(s.scalars(select(Trace.id).where(Trace.status == "analyzing")))
        rows = mapped(cluster)
        finished = {host for _, state, _, host in rows if state == "success"}
        for map_index, state, _, host in rows:
            first = ids[map_index * BATCH]  # batches in registration order
            slow = TRACE_FILES[map_index * BATCH] in SLOW
            if state == "running" and host in WORKERS and host in finished and slow and first in busy:
                cluster.kill(host)  # the whole worker, the task process with it, in the middle of the analysis
                return {"trace": first, "worker": host, "map_index": map_index}
        time.sleep(0.05)


def test_the_analyze_dag_fans_traces_out_over_two_celery_workers_and_a_killed_workers_batch_is_retried(
        cluster: CeleryCluster, pg_store: Store) -> None:
    ids = [register_trace(pg_store, TRACES / name, workflow_id=f"wf-{i}") for i, name in enumerate(TRACE_FILES)]
    cluster.airflow("dags", "trigger", "fleetlens_analyze", "--run-id", RUN_ID)
    cluster.airflow("dags", "unpause", "fleetlens_analyze")

    victim = kill_mid_trace(cluster, pg_store, ids)
    survivor = next(w for w in WORKERS if w != victim["worker"])
    with pg_store.session() as s:
        assert s.get(Trace, victim["trace"]).status == "analyzing"  # left mid-way by the dead worker

    # the scheduler finds the task's heartbeat gone (30 s here), fails the try, and retries it on the survivor
    cluster.wait("the run to finish after the retry", lambda: run_state(cluster) in ("success", "failed"),
                 timeout=600)
    batches = mapped(cluster)
    rows = {m: (state, tries, host) for m, state, tries, host in batches}
    assert run_state(cluster) == "success", f"{rows}\n{cluster.logs_tail()}"
    state, tries, host = rows[victim["map_index"]]
    assert state == "success" and tries >= 2 and host == survivor, rows

    # one mapped task per batch, each reporting what it analysed; the retried batch owes both its traces
    xcoms = dict(cluster.query(
        "SELECT map_index, value FROM xcom WHERE dag_id = 'fleetlens_analyze' AND run_id = :r "
        "AND task_id = 'analyze_traces' AND key = 'return_value'", r=RUN_ID))
    assert len(batches) == -(-len(ids) // BATCH), batches
    analysed_by: dict[int, str] = {}
    for map_index, state, _, hostname in batches:
        result = xcoms[map_index] if isinstance(xcoms[map_index], dict) else json.loads(xcoms[map_index])
        assert state == "success" and result["failed"] == [], (map_index, result)
        for trace_id in result["analyzed"]:
            analysed_by[trace_id] = hostname
    assert sorted(analysed_by) == sorted(ids), (analysed_by, xcoms)
    assert analysed_by[victim["trace"]] == survivor, analysed_by
    assert set(analysed_by.values()) == set(WORKERS), analysed_by  # both workers took batches, the victim before

    with pg_store.session() as s:
        assert {t.status for t in s.scalars(select(Trace))} == {"analyzed"}
        pairs = [(f.trace_id, f.rule) for f in s.scalars(select(Finding))]
        per_trace = dict(s.execute(select(Finding.trace_id, func.count()).group_by(Finding.trace_id)).all())
    assert len(pairs) == len(set(pairs))  # nothing written twice by the retry
    expected = {f.rule for f in analyze_one(TRACES / TRACE_FILES[ids.index(victim["trace"])])[1]}
    assert {r for t, r in pairs if t == victim["trace"]} == expected  # and nothing missing
    # a CPU-only trace has no GPU to waste: analysed, and rightly without a finding; every GPU trace has some
    cpu_only = ids[TRACE_FILES.index("cpu_ops_no_gpu.json.gz")]
    assert all(per_trace.get(i, 0) > 0 for i in ids if i != cpu_only), per_trace
    assert per_trace.get(cpu_only, 0) == 0, per_trace
