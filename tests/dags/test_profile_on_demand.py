"""fleetlens_profile_on_demand end to end: a real torch training job on the CPU (collector/examples/train.py) next to
a real `fleetlens agent`; the DAG asks for a profile, waits in reschedule mode, and the trace is analysed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select

from store.models import Finding, ProfileRequest, Trace
from store.workflows import upsert_workflow
from tests.collector.agent_helpers import wait_for
from tests.conftest import PROJECT_ROOT
from tests.dags.conftest import FleetStore

FLEETLENS = Path(sys.executable).with_name("fleetlens")
WORKFLOW = "od-input-bound"


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class LateJob:
    """Starts the training job only once the DAG's profile request is in the store, so the sensor's first poke
    finds the request still pending and has to give its worker slot back (reschedule) before the trace lands."""

    def __init__(self, fleet: FleetStore, env: dict[str, str]) -> None:
        self.fleet, self.env = fleet, env
        self.proc: subprocess.Popen | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.stopping = threading.Event()

    def _requested(self) -> bool:
        with self.fleet.store.session() as s:
            return s.scalar(select(ProfileRequest.id).where(ProfileRequest.workflow_id == WORKFLOW)) is not None

    def _run(self) -> None:
        while not self.stopping.wait(0.2):
            if self._requested():
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "collector.examples.train", "--mode", "input-bound", "--steps", "1000000",
                     "--loader-delay", "0.01"], env={**self.env, "FLEETLENS_WORKFLOW": WORKFLOW,
                                                     "FLEETLENS_SDK_FLUSH_INTERVAL_S": "0.2"},
                    cwd=PROJECT_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                return

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(5)
        if self.proc is not None:
            _stop(self.proc)


@pytest.fixture
def agent_and_late_job(dag_store: FleetStore) -> Iterator[LateJob]:
    """`fleetlens agent` (cpu source) on the store, and a real input-bound training job that starts on request."""
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT), "FLEETLENS_HOST_ID": "dag-test-host",
           "FLEETLENS_SOURCE": "cpu", "FLEETLENS_SAMPLE_INTERVAL_S": "0.5", "FLEETLENS_FLUSH_INTERVAL_S": "1"}
    agent = subprocess.Popen([str(FLEETLENS), "agent"], env=env, cwd=PROJECT_ROOT, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    late = LateJob(dag_store, env)
    try:
        socket = dag_store.home / "agent.sock"
        wait_for(lambda: socket.exists() or agent.poll() is not None, timeout=60)
        assert agent.poll() is None, agent.stderr.read()
        with dag_store.store.session() as s:  # the workflow is known (it ran before), its job starts later
            upsert_workflow(s, WORKFLOW, name="train-input-bound")
        late.thread.start()
        yield late
    finally:
        late.stop()
        _stop(agent)


@pytest.mark.slow
def test_on_demand_dag_profiles_a_real_job_and_analyses_its_trace(dag_store: FleetStore, dag_run,
                                                                  agent_and_late_job: LateJob) -> None:
    store = dag_store.store
    outcome = dag_run("fleetlens_profile_on_demand", conf={"workflow": WORKFLOW, "steps": 5})
    assert outcome["state"] == "success", outcome
    assert agent_and_late_job.proc is not None and agent_and_late_job.proc.poll() is None  # a live job answered
    tasks = outcome["tasks"]
    request_id = tasks["request_profile"]["result"]["request_id"]
    sensor = tasks["wait_for_trace"]
    assert sensor["result"]["done"] is True
    assert sensor["reschedules"] >= 1 and sensor["try_number"] == 1  # waited without holding a slot, no retries
    result = tasks["analyze_trace"]["result"]
    with store.session() as s:
        request = s.get(ProfileRequest, request_id)
        traces = list(s.scalars(select(Trace).where(Trace.profile_request_id == request_id)))
        findings = list(s.scalars(select(Finding).where(Finding.trace_id.in_([t.id for t in traces]))))
    assert (request.workflow_id, request.status, request.reason, request.requested_by) == (
        WORKFLOW, "done", "on_demand", "airflow")
    assert traces and all(t.status == "analyzed" and t.workflow_id == WORKFLOW for t in traces)
    assert all(Path(t.path).is_file() for t in traces)
    assert traces[0].summary["n_steps"] >= 1
    assert [t["id"] for t in result["traces"]] == [t.id for t in traces]
    assert sorted(f["id"] for f in result["findings"]) == sorted(f.id for f in findings)
    assert all(f.workflow_id == WORKFLOW and f.source == "trace" for f in findings)
    # its DataLoader sleeps 10 ms a batch for a tiny model: the trace shows an input-bound job
    assert "trace.input_pipeline" in {f.rule for f in findings}
