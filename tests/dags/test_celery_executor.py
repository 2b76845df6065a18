"""The analyze DAG on Airflow's Celery executor: Redis as the broker, PostgreSQL for Airflow's metadata, Celery's
results and the fleetlens store, a scheduler, a DAG processor, an API server and two Celery workers as real
processes. The traces fan out as mapped tasks over both workers; every trace ends analysed with its findings, also
when a worker is killed in the middle of one."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import func, select

from analyzer.traces import analyze_one, register_trace
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
WORKERS = ("fleet-worker-1", "fleet-worker-2")
RUN_ID = "celery-test"


@pytest.fixture
def make_cluster(tmp_path: Path, pg_url: str) -> Iterator[Callable[[int], CeleryCluster]]:
    """`make_cluster(batch_size)`: the whole deployment, started, with the fleetlens store at `pg_url`; stopped
    (and checked for leftovers by environment) after the test, pass or fail."""
    made: list[CeleryCluster] = []

    def make(batch_size: int) -> CeleryCluster:
        # a killed worker's claim on its trace lapses 20 s after its last renewal (120 s by default): its retry
        # retakes the trace soon after the scheduler has found the worker gone
        c = CeleryCluster(tmp_path, pg_base_url(), pg_url, {"FLEETLENS_ANALYZE_BATCH_SIZE": str(batch_size),
                                                             "FLEETLENS_TRACE_CLAIM_TIMEOUT_S": "20"})
        made.append(c)
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
        c.airflow("dags", "trigger", "fleetlens_analyze", "--run-id", RUN_ID)
        c.airflow("dags", "unpause", "fleetlens_analyze")
        return c

    yield make
    for c in made:
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


def test_the_analyze_dag_fans_traces_out_over_two_celery_workers(make_cluster, pg_store: Store) -> None:
    ids = [register_trace(pg_store, TRACES / name, workflow_id=f"wf-{i}") for i, name in enumerate(TRACE_FILES)]
    batch = 2
    cluster = make_cluster(batch)
    cluster.wait("the triggered run to finish", lambda: run_state(cluster) in ("success", "failed"), timeout=420)
    batches = mapped(cluster)
    assert run_state(cluster) == "success", f"{batches}\n{cluster.logs_tail()}"

    xcoms = dict(cluster.query(
        "SELECT map_index, value FROM xcom WHERE dag_id = 'fleetlens_analyze' AND run_id = :r "
        "AND task_id = 'analyze_traces' AND key = 'return_value'", r=RUN_ID))
    assert len(batches) == -(-len(ids) // batch)  # one mapped task per batch
    analysed_by: dict[int, str] = {}
    for map_index, state, _, hostname in batches:
        result = xcoms[map_index] if isinstance(xcoms[map_index], dict) else json.loads(xcoms[map_index])
        assert state == "success" and result["failed"] == [], (map_index, result)
        for trace_id in result["analyzed"]:
            analysed_by[trace_id] = hostname
    assert sorted(analysed_by) == sorted(ids)
    assert set(analysed_by.values()) == set(WORKERS), analysed_by  # both workers took batches

    with pg_store.session() as s:
        assert {t.status for t in s.scalars(select(Trace))} == {"analyzed"}
        per_trace = dict(s.execute(select(Finding.trace_id, func.count()).group_by(Finding.trace_id)).all())
    # a CPU-only trace has no GPU to waste: analysed, and rightly without a finding; every GPU trace has some
    cpu_only = ids[TRACE_FILES.index("cpu_ops_no_gpu.json.gz")]
    assert all(per_trace.get(i, 0) > 0 for i in ids if i != cpu_only), per_trace
    assert per_trace.get(cpu_only, 0) == 0, per_trace


def test_a_worker_killed_mid_trace_is_retried_on_the_other_and_nothing_is_half_written(
        make_cluster, pg_store: Store) -> None:
    # one trace per batch, the two slowest first, so that the kill lands while a trace is being analysed
    files = ["a100_80gb_16rank_rank0_training.json.gz", "a100_8rank_rank3_training.json.gz",
             "a100_2rank_nccl.json.gz", "a100_alexnet_microbench.json.gz"]
    ids = [register_trace(pg_store, TRACES / name, workflow_id=f"wf-{i}") for i, name in enumerate(files)]
    cluster = make_cluster(1)
    victim: dict[str, int | str] = {}
    deadline = time.monotonic() + 300
    while not victim:
        assert time.monotonic() < deadline and run_state(cluster) != "success", \
            "no trace was seen mid-analysis\n" + cluster.logs_tail()
        with pg_store.session() as s:
            busy = list(s.scalars(select(Trace.id).where(Trace.status == "analyzing")))
        running = {m: host for m, state, _, host in mapped(cluster) if state == "running"}
        for trace_id in busy:
            host = running.get(ids.index(trace_id))  # one trace per batch, batches in registration order
            if host in WORKERS:
                cluster.kill(host)  # the whole worker, the task process with it, in the middle of the analysis
                victim.update(trace=trace_id, worker=host, map_index=ids.index(trace_id))
                break
        time.sleep(0.1)
    survivor = next(w for w in WORKERS if w != victim["worker"])
    with pg_store.session() as s:
        assert s.get(Trace, victim["trace"]).status == "analyzing"  # left mid-way by the dead worker

    # the scheduler finds the task's heartbeat gone (30 s here), fails the try, and retries it on the survivor
    cluster.wait("the run to finish after the retry", lambda: run_state(cluster) in ("success", "failed"),
                 timeout=600)
    rows = {m: (state, tries, host) for m, state, tries, host in mapped(cluster)}
    assert run_state(cluster) == "success", f"{rows}\n{cluster.logs_tail()}"
    state, tries, host = rows[victim["map_index"]]
    assert state == "success" and tries >= 2 and host == survivor, rows
    with pg_store.session() as s:
        assert {t.status for t in s.scalars(select(Trace))} == {"analyzed"}
        pairs = [(f.trace_id, f.rule) for f in s.scalars(select(Finding))]
    assert len(pairs) == len(set(pairs))  # nothing written twice by the retry
    expected = {f.rule for f in analyze_one(TRACES / files[ids.index(victim["trace"])])[1]}
    assert {r for t, r in pairs if t == victim["trace"]} == expected  # and nothing missing
