"""Every fleetlens DAG against a real seeded SQLite store, with dag.test() on a temporary Airflow metadata DB:
the DagBag loads, and each run changes the store as it should (rollups, findings, plans, profile requests)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from sqlalchemy import func, select

from analyzer import periodic
from analyzer.slurm_holders import RULE as SLURM_RULE
from analyzer.traces import register_trace
from collector.importers.slurm import import_slurm
from store.models import Action, DeviceSample, Finding, Plan, ProcessSample, ProfileRequest, Rollup, Trace
from store.registry import register_host
from store.settings import get_settings
from tests.conftest import TRACES
from tests.dags.conftest import DAGS, FleetStore
from tests.dags.seed import flag_idle
from tests.fakes.fake_slurm import SlurmAnswers

DAG_IDS = {"fleetlens_rollup", "fleetlens_analyze", "fleetlens_enforce", "fleetlens_periodic_profile",
           "fleetlens_profile_on_demand", "fleetlens_import_prometheus", "fleetlens_import_slurm"}


def count(store, model, *where) -> int:
    with store.session() as s:
        return s.scalar(select(func.count()).select_from(model).where(*where))


def test_dagbag_loads_every_dag_with_retries_on_an_unreachable_database(airflow_home: Path) -> None:
    from airflow.dag_processing.dagbag import DagBag

    from store.errors import DatabaseUnavailable, NotFound

    bag = DagBag(dag_folder=str(DAGS))
    assert bag.import_errors == {}
    assert set(bag.dag_ids) == DAG_IDS
    for dag in bag.dags.values():
        for t in dag.tasks:
            assert t.retries >= 3 and t.retry_exponential_backoff > 0, t.task_id
            retry = t.retry_policy.evaluate(DatabaseUnavailable("db down"), 1, 5)
            fail = t.retry_policy.evaluate(NotFound("no workflow"), 1, 5)
            assert (retry.action.value, fail.action.value) == ("retry", "fail"), t.task_id
    sensor = bag.get_dag("fleetlens_profile_on_demand").get_task("wait_for_trace")
    assert sensor.mode == "reschedule"
    assert type(bag.get_dag("fleetlens_profile_on_demand").timetable).__name__ == "NullTimetable"  # manual only


def test_the_embedded_scheduler_runs_each_dag_on_its_cadence(airflow_home: Path) -> None:
    import pendulum
    from airflow.dag_processing.dagbag import DagBag
    from airflow.serialization.encoders import coerce_to_core_timetable

    from ui.serve.scheduler import CADENCES

    bag = DagBag(dag_folder=str(DAGS))
    t0 = pendulum.datetime(2026, 1, 5, tz="UTC")
    assert set(CADENCES) == DAG_IDS - {"fleetlens_profile_on_demand"}
    for dag_id, seconds in CADENCES.items():
        timetable = coerce_to_core_timetable(bag.get_dag(dag_id).timetable)
        first = timetable._get_next(t0)  # the cron's next fire after t0, then the one after it
        assert (timetable._get_next(first) - first).total_seconds() == seconds, dag_id


@pytest.mark.slow
def test_rollup_dag_writes_rollups_and_drops_only_rolled_up_samples(dag_store: FleetStore, dag_run,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    store = dag_store.store
    monkeypatch.setenv("FLEETLENS_RETENTION_DAYS", "0.05")  # 72 minutes: the older seeded hours go
    before = count(store, DeviceSample), count(store, ProcessSample)
    outcome = dag_run("fleetlens_rollup")
    assert outcome["state"] == "success", outcome
    rolled = outcome["tasks"]["rollup_hours"]["result"]
    assert rolled["hours"] >= 4 and rolled["device_rows"] > 0 and rolled["workflow_rows"] > 0
    with store.session() as s:
        scopes = dict(s.execute(select(Rollup.scope, func.count()).group_by(Rollup.scope)).all())
        wf_hours = s.scalar(select(func.sum(Rollup.gpu_hours_held)).where(Rollup.scope == "workflow",
                                                                           Rollup.subject == "busy-c"))
    assert scopes["device"] == rolled["device_rows"] and scopes["workflow"] == rolled["workflow_rows"]
    assert 2.0 < wf_hours <= 3.0  # busy-c held its device for the closed hours of its 3 h
    retained = outcome["tasks"]["apply_retention"]["result"]
    assert retained["device_samples_deleted"] > 0 and retained["process_samples_deleted"] > 0
    after = count(store, DeviceSample), count(store, ProcessSample)
    assert after == (before[0] - retained["device_samples_deleted"], before[1] - retained["process_samples_deleted"])
    # nothing older than the cutoff stays unless its hour was not rolled up; nothing newer went
    assert count(store, DeviceSample, DeviceSample.ts < retained["cutoff"]) == 0
    assert count(store, DeviceSample, DeviceSample.ts >= retained["cutoff"]) == before[0] - retained[
        "device_samples_deleted"]


@pytest.mark.slow
def test_analyze_dag_records_telemetry_findings_and_analyses_pending_traces(dag_store: FleetStore, dag_run) -> None:
    store = dag_store.store
    trace_file = TRACES / "a100_alexnet_microbench.json.gz"  # a real Kineto trace, small
    trace_id = register_trace(store, trace_file, workflow_id="busy-c")
    # a Slurm job running for an hour on n1, whose agent sees no process of it there
    now, slurm = time.time(), SlurmAnswers()
    slurm.jobs = [{"job_id": 42, "job_state": "RUNNING", "submit_time": now - 7200, "start_time": int(now - 3600),
                   "tres_per_node": "gres:gpu:1", "requeue": True, "user_name": "u", "name": "train", "nodes": "n1",
                   "batch_host": "n1", "gres_detail": ["gpu:1(IDX:0)"]}]
    import_slurm(store, get_settings(fresh=True), cli=slurm, now=now)
    with store.session() as s:
        register_host(s, "n1", hostname="n1", source="nvml", now=now)
    outcome = dag_run("fleetlens_analyze")
    assert outcome["state"] == "success", outcome
    with store.session() as s:
        telemetry = {(f.workflow_id, f.rule) for f in s.scalars(select(Finding).where(
            Finding.source == "telemetry", Finding.rule != SLURM_RULE))}
        trace = s.get(Trace, trace_id)
    assert ("idle-a", "idle_holder") in telemetry
    assert ("idle-b", "low_utilization") in telemetry
    assert not any(wf == "busy-c" for wf, _ in telemetry)  # 90 % busy: nothing to say
    assert trace.status == "analyzed" and trace.summary["n_steps"] > 0
    assert outcome["tasks"]["slurm_gpus_without_process"]["result"] == 1
    with store.session() as s:
        assert s.scalars(select(Finding.workflow_id).where(Finding.rule == SLURM_RULE)).all() == ["slurm-42"]
    assert outcome["tasks"]["trace_batches"]["result"] == [[trace_id]]
    mapped = outcome["tasks"]["analyze_traces"]["mapped"]
    assert [m["result"] for m in mapped] == [{"analyzed": [trace_id], "failed": [], "skipped": []}]
    result = outcome["tasks"]["detect_telemetry"]["result"]
    assert result["findings"] == len(telemetry)
    # the fleet total comes from the one waste function: what the findings claim, never more than held
    assert 0 < result["recoverable_gpu_hours_per_day"] <= result["held_gpu_hours_per_day"]


@pytest.mark.slow
def test_enforce_dag_dry_runs_unless_the_variable_switches_it_on(dag_store: FleetStore, dag_run,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    store = dag_store.store
    monkeypatch.setenv("FLEETLENS_ENFORCE_DRIVE_S", "0")  # one step of each migration: no agent answers here
    flag_idle(store, dag_store.seeded)
    outcome = dag_run("fleetlens_enforce")
    assert outcome["state"] == "success", outcome
    result = outcome["tasks"]["enforcement_cycle"]["result"]
    assert result["moves"] == 2 and result["devices_freed"] == 2
    with store.session() as s:
        plan = s.get(Plan, result["plan_id"])
        assert not plan.applied and plan.summary["outcome"]["mode"] == "dry_run"
    assert count(store, Action) == 0

    outcome = dag_run("fleetlens_enforce", variables={"fleetlens_enforce": "true"})
    assert outcome["state"] == "success", outcome
    result = outcome["tasks"]["enforcement_cycle"]["result"]
    with store.session() as s:
        plan = s.get(Plan, result["plan_id"])
        assert plan.applied and plan.summary["outcome"]["mode"] == "enforce"
        actions = list(s.scalars(select(Action).where(Action.plan_id == plan.id)))
    assert sorted(a.workflow_id for a in actions) == ["idle-a", "idle-b"]
    assert sorted(a.id for a in actions) == sorted(plan.summary["outcome"]["actions"])
    # driven one step: each asked its host's agent for a checkpoint (the migration state machine's first step)
    assert set(result["driven"]) == {str(a.id) for a in actions}
    assert {a.state for a in actions} == {"checkpoint_requested"}


@pytest.mark.slow
def test_periodic_profile_dag_requests_the_top_workflows_by_gpu_hours(dag_store: FleetStore, dag_run,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    store = dag_store.store
    periodic.rollup_hours(store, get_settings(fresh=True))
    monkeypatch.setenv("FLEETLENS_PROFILE_TOP_N", "2")
    monkeypatch.setenv("FLEETLENS_PROFILE_STEPS", "7")
    outcome = dag_run("fleetlens_periodic_profile")
    assert outcome["state"] == "success", outcome
    with store.session() as s:
        requests = list(s.scalars(select(ProfileRequest).order_by(ProfileRequest.id)))
    # done-d held the most GPU-hours but has finished; idle-b held its device for less time than the others
    assert [(r.workflow_id, r.reason, r.steps, r.status) for r in requests] == [
        ("busy-c", "periodic", 7, "pending"), ("idle-a", "periodic", 7, "pending")]
    assert outcome["tasks"]["request_profiles"]["result"]["skipped"] == {"done-d": "not running"}


@pytest.mark.slow
def test_on_demand_dag_fails_its_first_task_for_an_unknown_workflow(dag_store: FleetStore, dag_run,
                                                                   capfd: pytest.CaptureFixture) -> None:
    outcome = dag_run("fleetlens_profile_on_demand", conf={"workflow": "no-such-job", "steps": 5})
    assert outcome["state"] == "failed"
    first = outcome["tasks"]["request_profile"]
    assert first["state"] == "failed" and first["try_number"] == 1  # not retried: it would fail the same way
    assert {outcome["tasks"][t]["state"] for t in ("wait_for_trace", "analyze_trace")} == {"upstream_failed"}
    out, err = capfd.readouterr()
    assert "no workflow 'no-such-job' in the store" in out + err
    assert count(dag_store.store, ProfileRequest) == 0


@pytest.mark.slow
def test_enforce_dag_refuses_a_variable_it_cannot_read(dag_store: FleetStore, dag_run,
                                                       capfd: pytest.CaptureFixture) -> None:
    outcome = dag_run("fleetlens_enforce", variables={"fleetlens_enforce": "maybe"})
    assert outcome["state"] == "failed"
    assert outcome["tasks"]["enforcement_cycle"]["try_number"] == 1
    out, err = capfd.readouterr()
    assert "the Airflow Variable fleetlens_enforce is 'maybe'; set it to true or false" in out + err
    assert count(dag_store.store, Plan) == 0  # nothing planned on a setting nobody meant
