"""Run one fleetlens DAG with dag.test() and report each task's state, tries and return value.

The DAG tests call `run_dag` in-process, after their session fixture has pointed AIRFLOW_HOME at a migrated
temporary metadata DB. From a shell (AIRFLOW_HOME and FLEETLENS_* exported) it prints one JSON line:

    python -m tests.dags.run_dag DAG_ID [--conf JSON] [--variables FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DAGS = Path(__file__).resolve().parents[2] / "dags"


def run_dag(dag_id: str, conf: dict | None = None, variables: str | Path | None = None) -> dict:
    """dag.test() one DAG of dags/; returns {"dag_id", "state", "tasks": {task_id: {state, try_number, reschedules,
    result}}} (reschedules: how often a sensor in reschedule mode gave its slot back); a mapped task is
    {state, mapped: [one such dict per mapped instance]}."""
    from airflow.dag_processing.dagbag import DagBag
    from airflow.models.taskreschedule import TaskReschedule
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    bag = DagBag(dag_folder=str(DAGS / f"{dag_id}.py"))
    if bag.import_errors:
        return {"dag_id": dag_id, "state": "import_error", "tasks": {}, "import_errors": dict(bag.import_errors)}
    dag = bag.get_dag(dag_id)
    run = dag.test(run_conf=conf, variable_file_path=str(variables) if variables else None)
    tasks: dict[str, dict] = {}
    with create_session() as session:
        for ti in sorted(run.get_task_instances(session=session), key=lambda t: (t.task_id, t.map_index)):
            value = session.query(XComModel.value).filter_by(
                dag_id=ti.dag_id, run_id=ti.run_id, task_id=ti.task_id, map_index=ti.map_index,
                key="return_value").scalar()
            reschedules = session.query(TaskReschedule).filter(TaskReschedule.ti_id == ti.id).count()
            one = {"state": str(ti.state), "try_number": ti.try_number, "reschedules": reschedules,
                   "result": json.loads(value) if isinstance(value, str) else value}
            if ti.map_index < 0:
                tasks[ti.task_id] = one
            else:  # a mapped task: its instances in map_index order, the state when they all agree
                mapped = tasks.setdefault(ti.task_id, {"state": one["state"], "mapped": []})
                mapped["mapped"].append(one)
                if mapped["state"] != one["state"]:
                    mapped["state"] = "mixed"
    return {"dag_id": dag_id, "state": str(run.state), "tasks": tasks}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("dag_id")
    ap.add_argument("--conf", default=None, help="the run's conf (params), as JSON")
    ap.add_argument("--variables", default=None, help="a JSON file of Airflow Variables")
    args = ap.parse_args(argv)
    outcome = run_dag(args.dag_id, json.loads(args.conf) if args.conf else None, args.variables)
    print(json.dumps(outcome, default=str))
    return 0 if outcome["state"] == "success" else 1


if __name__ == "__main__":
    sys.exit(main())
