"""fleetlens_profile_on_demand (manual; params workflow, steps): ask the workflow's running job to trace its next
steps, wait for the trace without holding a worker slot (a sensor in reschedule mode), analyse it and record the
findings. The job must run with the fleetlens job SDK, next to a `fleetlens agent`."""

from __future__ import annotations

from datetime import timedelta

from airflow.sdk import Param, PokeReturnValue, dag, task

from analyzer import profiles
from dags._runtime import DEFAULT_ARGS, START, TAGS, run

PARAMS = {
    "workflow": Param(type="string", minLength=1, description="the workflow id (FLEETLENS_WORKFLOW of the job)"),
    "steps": Param(10, type="integer", minimum=1, maximum=10_000, description="training steps to trace"),
}


@dag(dag_id="fleetlens_profile_on_demand", schedule=None, start_date=START, catchup=False, params=PARAMS,
     default_args=DEFAULT_ARGS, tags=TAGS, doc_md=__doc__)
def fleetlens_profile_on_demand() -> None:
    @task
    def request_profile(params: dict | None = None) -> dict:
        return run(profiles.request_on_demand, params["workflow"], params["steps"], requested_by="airflow")

    # reschedule mode frees the worker slot between pokes; the wait covers the request's time to be picked up
    # (FLEETLENS_PROFILE_TTL_S) plus the capture (FLEETLENS_PROFILE_CAPTURE_TIMEOUT_S), whose end the poke reports
    @task.sensor(mode="reschedule", poke_interval=5, exponential_backoff=True, max_wait=60,
                 timeout=timedelta(minutes=30).total_seconds())
    def wait_for_trace(request: dict) -> PokeReturnValue:
        status = run(profiles.request_status, request["request_id"])
        return PokeReturnValue(is_done=status["done"], xcom_value=status)

    @task
    def analyze_trace(status: dict) -> dict:
        return run(profiles.analyze_request, status["request_id"])

    analyze_trace(wait_for_trace(request_profile()))


fleetlens_profile_on_demand()
