"""`fleetlens demo` end to end on this machine: real agent, real torch jobs, real traces, a real migration, the
dashboard; a normal end stops all of it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import select

from store.db import Store
from store.models import Action, Finding, StepStat, Trace, Workflow
from tests.serve.stop_helpers import free_port
from ui.serve.processes import processes_of

FLEETLENS = str(Path(sys.executable).with_name("fleetlens"))
pytestmark = pytest.mark.slow


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETLENS_")}
    env.update({"FLEETLENS_HOME": str(home), "FLEETLENS_SECRET": "demo-test-secret"})
    return env


def _rules(session, workflow_id: str) -> set[str]:
    return set(session.scalars(select(Finding.rule).where(Finding.workflow_id == workflow_id,
                                                          Finding.status != "resolved")))


def test_demo_runs_the_whole_loop_and_leaves_nothing_running(tmp_path):
    # the dashboard too: the loop outlasts --duration, so the demo ends normally once the dashboard is up, and
    # stops it with everything else (the signal tests stop the demo in the phases before)
    home = tmp_path / "home"
    port = free_port()
    result = subprocess.run([FLEETLENS, "demo", "--port", str(port), "--duration", "90"], env=_env(home),
                            cwd=tmp_path, capture_output=True, text=True, timeout=900)
    demo_home = home / "demo"
    summary = json.loads((demo_home / "demo-summary.json").read_text())
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert summary["steps_failed"] == []
    assert summary["dashboard"] == f"http://127.0.0.1:{port}" and "dashboard at" in result.stdout
    jobs = {name: job["workflow"] for name, job in summary["jobs"].items()}
    assert set(jobs) == {"healthy", "tiny-steps", "input-bound", "idle-holder"}

    store = Store(summary["db_url"])
    with store.session() as s:
        for name, wf in jobs.items():
            # the jobs reported steps through the SDK and the agent
            assert s.scalar(select(StepStat.id).where(StepStat.workflow_id == wf).limit(1)), name
            # each was profiled on demand, and its trace analysed
            traces = s.scalars(select(Trace).where(Trace.workflow_id == wf)).all()
            assert traces and all(t.profile_request_id for t in traces), name
            assert {t.status for t in traces} == {"analyzed"}, name
        # the findings they deserve, and none the healthy job does not
        assert "trace.input_pipeline" in _rules(s, jobs["input-bound"])
        assert "idle_holder" in _rules(s, jobs["idle-holder"])
        assert "trace.tiny_steps" in _rules(s, jobs["tiny-steps"])
        assert _rules(s, jobs["healthy"]) == set()

        # at least one migration finished, the job resuming from its checkpoint with no step lost before it
        resumed = s.scalars(select(Action).where(Action.state == "resumed")).all()
        assert resumed, summary["migrations"]
        for action in resumed:
            assert action.checkpoint_step is not None and action.checkpoint_step > 0
            stats = s.scalars(select(StepStat).where(StepStat.workflow_id == action.workflow_id)
                              .order_by(StepStat.ts_start)).all()
            after = [st for st in stats if st.ts_start >= action.created_at and st.first_step == action.checkpoint_step]
            assert after, f"{action.workflow_id} did not resume at step {action.checkpoint_step}"
            assert len({st.pid for st in stats}) >= 2  # a new process continued the work
            covered = sorted((st.first_step, st.last_step) for st in stats if st.first_step < action.checkpoint_step)
            assert covered[0][0] == 0
            for (_, last), (first, _) in zip(covered, covered[1:], strict=False):
                assert first <= last + 1, "a step before the checkpoint was lost"
        assert summary["devices_freed"] >= 1

        # the replayed fleet's idle containers were flagged
        replayed_idle = s.scalars(select(Finding.workflow_id).join(Workflow, Workflow.id == Finding.workflow_id)
                                  .where(Finding.rule == "idle_holder", Workflow.id.not_in(jobs.values()),
                                         Workflow.id_source != "cmdline")).all()
        assert len(set(replayed_idle)) >= 100
    assert summary["fleet"]["workflows"] == 143
    # the one waste function's total: never more than the GPU-hours held
    assert 0 < summary["gpu_hours_recoverable_per_day"] <= summary["gpu_hours_held_per_day"]
    assert "devices freed" in result.stdout

    assert list(processes_of(demo_home)) == []
