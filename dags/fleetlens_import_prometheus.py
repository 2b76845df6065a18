"""fleetlens_import_prometheus (every 5 minutes): import dcgm-exporter telemetry from FLEETLENS_PROMETHEUS_URL.

Each run resumes where the last one stopped (per device), so a missed or failed run is caught up by the next;
without FLEETLENS_PROMETHEUS_URL the task does nothing.
"""

from __future__ import annotations

from airflow.sdk import dag, task

from collector.importers.prometheus import import_from_settings
from dags._runtime import DEFAULT_ARGS, START, TAGS, run


@dag(dag_id="fleetlens_import_prometheus", schedule="*/5 * * * *", start_date=START, catchup=False,
     max_active_runs=1, default_args=DEFAULT_ARGS, tags=TAGS, doc_md=__doc__)
def fleetlens_import_prometheus() -> None:
    @task
    def import_prometheus() -> dict:
        return run(import_from_settings)

    import_prometheus()


fleetlens_import_prometheus()
