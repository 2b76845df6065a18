"""fleetlens_analyze (every 15 minutes): the telemetry detectors, the analysis of traces not analysed yet, fanned
out over the workers as one mapped task per batch of `FLEETLENS_ANALYZE_BATCH_SIZE` traces, and the Slurm jobs holding
GPUs that none of their processes uses (as `fleetlens serve`'s analyze job)."""

from __future__ import annotations

from airflow.sdk import dag, task

from analyzer import periodic
from dags._runtime import DEFAULT_ARGS, START, TAGS, run


@dag(dag_id="fleetlens_analyze", schedule="*/15 * * * *", start_date=START, catchup=False, max_active_runs=1,
     default_args=DEFAULT_ARGS, tags=TAGS, doc_md=__doc__)
def fleetlens_analyze() -> None:
    @task
    def detect_telemetry() -> dict:
        return run(periodic.detect_telemetry)

    @task
    def trace_batches() -> list[list[int]]:
        return run(periodic.trace_batches)

    @task
    def analyze_traces(trace_ids: list[int]) -> dict:
        return run(periodic.analyze_trace_batch, trace_ids)

    @task
    def slurm_gpus_without_process() -> int:
        return run(periodic.slurm_gpus_without_process)

    detect_telemetry()
    analyze_traces.expand(trace_ids=trace_batches())
    slurm_gpus_without_process()


fleetlens_analyze()
