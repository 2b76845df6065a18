"""fleetlens_periodic_profile (daily): profile requests for the running workflows with the most GPU-hours
(FLEETLENS_PROFILE_TOP_N of them, FLEETLENS_PROFILE_STEPS steps each); fleetlens_analyze analyses the traces."""

from __future__ import annotations

from airflow.sdk import dag, task

from analyzer import profiles
from dags._runtime import DEFAULT_ARGS, START, TAGS, run


@dag(dag_id="fleetlens_periodic_profile", schedule="@daily", start_date=START, catchup=False, max_active_runs=1,
     default_args=DEFAULT_ARGS, tags=TAGS, doc_md=__doc__)
def fleetlens_periodic_profile() -> None:
    @task
    def request_profiles() -> dict:
        return run(profiles.profile_top_workflows)

    request_profiles()


fleetlens_periodic_profile()
