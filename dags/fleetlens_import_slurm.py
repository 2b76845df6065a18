"""fleetlens_import_slurm (every minute): read a Slurm cluster's jobs and nodes (squeue/sinfo JSON) into the store.

Jobs become workflows slurm-<id> with what they hold and whether they opted in to be moved; the enforce DAG plans
and moves from that. Without FLEETLENS_SLURM the task does nothing.
"""

from __future__ import annotations

from airflow.sdk import dag, task

from collector.importers.slurm import import_slurm_from_settings
from dags._runtime import DEFAULT_ARGS, START, TAGS, run


@dag(dag_id="fleetlens_import_slurm", schedule="* * * * *", start_date=START, catchup=False,
     max_active_runs=1, default_args=DEFAULT_ARGS, tags=TAGS, doc_md=__doc__)
def fleetlens_import_slurm() -> None:
    @task
    def import_slurm() -> dict:
        return run(import_slurm_from_settings)

    import_slurm()


fleetlens_import_slurm()
