"""fleetlens_enforce (every 15 minutes): plan under the configured policy (FLEETLENS_POLICY), apply the plan only
when enforcement is switched on (FLEETLENS_ENFORCE=true or the Airflow Variable fleetlens_enforce=true; a dry run
otherwise), record the plan and its outcome, and drive the migrations under way."""

from __future__ import annotations

from airflow.sdk import dag, task

from dags._runtime import DEFAULT_ARGS, START, TAGS, enforce_variable, run
from enforcer import cycle


@dag(dag_id="fleetlens_enforce", schedule="*/15 * * * *", start_date=START, catchup=False, max_active_runs=1,
     default_args=DEFAULT_ARGS, tags=TAGS, doc_md=__doc__)
def fleetlens_enforce() -> None:
    @task
    def enforcement_cycle() -> dict:
        return run(cycle.run_cycle, enforce=enforce_variable())

    enforcement_cycle()


fleetlens_enforce()
