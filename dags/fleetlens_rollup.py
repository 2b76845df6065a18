"""fleetlens_rollup (hourly): roll up the closed hours of raw samples, then drop raw samples past retention."""

from __future__ import annotations

from airflow.sdk import dag, task

from analyzer import periodic
from dags._runtime import DEFAULT_ARGS, START, TAGS, run


@dag(dag_id="fleetlens_rollup", schedule="@hourly", start_date=START, catchup=False, max_active_runs=1,
     default_args=DEFAULT_ARGS, tags=TAGS, doc_md=__doc__)
def fleetlens_rollup() -> None:
    @task
    def rollup_hours() -> dict:
        return run(periodic.rollup_hours)

    @task
    def apply_retention() -> dict:
        return run(periodic.retain)

    # retention only deletes hours already rolled up, so it goes second
    rollup_hours() >> apply_retention()


fleetlens_rollup()
