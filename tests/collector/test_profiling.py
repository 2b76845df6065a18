"""On-demand profiling: the store's request life cycle, `fleetlens profile`, and real captures from real torch
training loops (in-process against the SDK handlers, and end to end with a real agent process) that HTA reads."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from sqlalchemy import select

from collector.job import job
from store import profiling
from store.db import Store
from store.errors import InvalidInput, NotFound
from store.migrations import upgrade
from store.models import ProfileRequest, StepStat, Trace
from store.settings import get_settings
from store.workflows import upsert_workflow
from tests.collector.agent_helpers import wait_for
from tests.collector.test_job_sdk import Served, finish, start_train
from tests.conftest import PROJECT_ROOT
from ui.cli import run


def trace_events(path: str | Path) -> dict:
    with gzip.open(path, "rt") as f:
        return json.load(f)


def profiler_steps(trace: dict) -> list[str]:
    return sorted({e["name"] for e in trace["traceEvents"] if str(e.get("name", "")).startswith("ProfilerStep#")})


def load_with_hta(folder: Path, rank: int) -> None:
    from hta.trace_analysis import TraceAnalysis

    analysis = TraceAnalysis(trace_dir=str(folder))
    assert list(analysis.t.traces) == [rank]
    frame = analysis.t.get_trace(rank)
    names = set(analysis.t.symbol_table.get_sym_table())
    assert len(frame) > 0 and any(n.startswith("ProfilerStep#") for n in names)


@pytest.fixture
def served(fleet_home: Path):
    agent = Served(get_settings(fresh=True))
    yield agent
    agent.stop()
    agent.store.dispose()


# ---- the store's side ---------------------------------------------------------------------------------------

def test_request_life_cycle(any_store: Store, tmp_path: Path) -> None:
    with any_store.session() as s:
        upsert_workflow(s, "wf")
        with pytest.raises(NotFound, match="no workflow 'ghost'"):
            profiling.request_profile(s, "ghost", 5)
        for bad in (0, -1, 10**6, True, 2.5):
            with pytest.raises(InvalidInput):
                profiling.request_profile(s, "wf", bad)
        with pytest.raises(InvalidInput, match="reason"):
            profiling.request_profile(s, "wf", 5, reason="because")
        request = profiling.request_profile(s, "wf", 5, requested_by="ann", now=100.0)
        assert (request.status, request.expires_at) == ("pending", 700.0)
        rid = request.id
    with any_store.session() as s:
        assert profiling.pending_request(s, "wf", now=101.0).id == rid
        assert profiling.claim(s, rid, now=102.0).status == "capturing"
        assert profiling.claim(s, rid, now=103.0) is None  # two agents never both claim it
        assert profiling.pending_request(s, "wf", now=104.0) is None
        with pytest.raises(InvalidInput, match="does not exist"):
            profiling.register_trace(s, "wf", tmp_path / "missing.json.gz", 0, rid)
        assert s.scalar(select(Trace).where(Trace.profile_request_id == rid)) is None
        path = tmp_path / "rank0.json.gz"
        path.write_bytes(b"0123456789")
        trace = profiling.register_trace(s, "wf", path, 0, rid, host_id="h", steps=5)
        assert (trace.size_bytes, trace.status) == (10, "registered")
        profiling.complete(s, rid, now=105.0)
        profiling.fail(s, rid, "too late")  # an ended request stays as it ended
    with any_store.session() as s:
        request = profiling.get_request(s, rid)
        assert (request.status, request.completed_at, request.error) == ("done", 105.0, None)
        assert [t.path for t in profiling.traces_for_request(s, rid)] == [str(path)]
        with pytest.raises(NotFound):
            profiling.get_request(s, rid + 1000)


def test_stale_requests_expire_or_fail_with_a_reason(any_store: Store) -> None:
    with any_store.session() as s:
        upsert_workflow(s, "wf")
        waiting = profiling.request_profile(s, "wf", 3, ttl_s=10, now=0.0).id
        stuck = profiling.request_profile(s, "wf", 3, ttl_s=10, now=0.0).id
        profiling.claim(s, stuck, now=1.0)
        fresh = profiling.request_profile(s, "wf", 3, ttl_s=10, now=95.0).id
    with any_store.session() as s:
        assert profiling.expire_stale(s, capture_timeout_s=50, now=100.0) == 2
    with any_store.session() as s:
        w, st, f = (profiling.get_request(s, i) for i in (waiting, stuck, fresh))
        assert w.status == "expired" and "is `fleetlens agent` running" in w.error
        assert st.status == "failed" and "sent no trace within 50 s" in st.error
        assert f.status == "pending"


# ---- fleetlens profile --------------------------------------------------------------------------------------

@pytest.fixture
def cli_store(fleet_home: Path):
    settings = get_settings(fresh=True)
    settings.ensure_home()
    store = Store.from_settings(settings)
    upgrade(store)
    yield store
    store.dispose()


def test_cli_profile_unknown_workflow_and_bad_timeout(cli_store: Store, capsys: pytest.CaptureFixture) -> None:
    assert run(["profile", "ghost", "--steps", "3"]) == 2
    assert "no workflow 'ghost'" in capsys.readouterr().err
    with cli_store.session() as s:
        upsert_workflow(s, "wf")
    assert run(["profile", "wf", "--steps", "0"]) == 2
    assert "between 1 and" in capsys.readouterr().err
    assert run(["profile", "wf", "--timeout", "0"]) == 2
    with cli_store.session() as s:
        assert s.scalar(select(ProfileRequest)) is None  # nothing half-made


def test_cli_profile_with_no_job_expires_with_a_reason(cli_store: Store, capsys: pytest.CaptureFixture) -> None:
    with cli_store.session() as s:
        upsert_workflow(s, "idle")
    assert run(["profile", "idle", "--steps", "3", "--timeout", "0.5"]) == 2
    err = capsys.readouterr().err
    assert "expired" in err and "collector.job" in err
    with cli_store.session() as s:
        request = s.scalar(select(ProfileRequest))
        assert request.status == "expired" and "within 0.5 s" in request.error


def test_cli_profile_no_wait_leaves_a_pending_request(cli_store: Store, capsys: pytest.CaptureFixture) -> None:
    with cli_store.session() as s:
        upsert_workflow(s, "wf")
    assert run(["profile", "wf", "--steps", "4", "--no-wait"]) == 0
    request_id = int(capsys.readouterr().out.strip())
    with cli_store.session() as s:
        request = profiling.get_request(s, request_id)
        assert (request.status, request.steps, request.workflow_id) == ("pending", 4, "wf")


# ---- captures from real training loops ----------------------------------------------------------------------

def test_capture_in_a_torch_loop_registers_a_trace_hta_reads(served: Served) -> None:
    with served.store.session() as s:
        upsert_workflow(s, "cap-wf")
        request_id = profiling.request_profile(s, "cap-wf", 4).id
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    settings = served.settings.model_copy(update={"sdk_flush_interval_s": 0.02, "rank": 3})
    with job("cap", total_steps=100_000, workflow="cap-wf", settings=settings) as j:
        for _ in j.steps():
            loss = model(torch.randn(16, 32)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if j.traces:
                break
            time.sleep(0.001)
    assert j.step < 100_000
    trace = wait_for(lambda: _trace_of(served.store, request_id))
    assert (trace.rank, trace.steps, trace.host_id, trace.workflow_id) == (3, 4, "test-host", "cap-wf")
    path = Path(trace.path)
    assert path.parent == served.settings.trace_dir / "cap-wf" / f"request-{request_id}"
    assert trace.size_bytes == path.stat().st_size
    data = trace_events(path)
    assert next(iter(data)) == "distributedInfo" and data["distributedInfo"]["rank"] == 3
    assert len(profiler_steps(data)) == 4
    assert not [f for f in path.parent.iterdir() if f != path]  # no temporary files left for HTA to trip on
    with served.store.session() as s:
        assert profiling.get_request(s, request_id).status == "done"
    load_with_hta(path.parent, 3)


def test_a_capture_the_job_reports_failed_fails_the_request(served: Served) -> None:
    with served.store.session() as s:
        upsert_workflow(s, "f-wf")
        request_id = profiling.request_profile(s, "f-wf", 4).id
    reply = served.handlers.handle({"op": "profile_failed", "v": 1, "workflow": "f-wf", "pid": 1,
                                    "request_id": request_id, "error": "profiler already running"})
    assert reply == {"ok": True}
    served.handlers.flush()
    with served.store.session() as s:
        request = profiling.get_request(s, request_id)
        assert request.status == "failed" and "profiler already running" in request.error


def _trace_of(store: Store, request_id: int) -> Trace | None:
    with store.session() as s:
        return s.scalar(select(Trace).where(Trace.profile_request_id == request_id))


@pytest.mark.slow
def test_end_to_end_real_agent_real_job_cli_trace_hta(fleet_home: Path, capsys: pytest.CaptureFixture) -> None:
    settings = get_settings(fresh=True)
    assert run(["init"]) == 0
    store = Store.from_settings(settings)
    agent = subprocess.Popen(
        [sys.executable, "-c", "from ui.cli import main; main()", "agent", "--source", "cpu", "--interval", "0.5",
         "--flush-interval", "1", "--host-id", "e2e-host"],
        cwd=PROJECT_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    train = None
    try:
        wait_for(lambda: settings.socket_path.exists() or agent.poll() is not None, timeout=60)
        assert agent.poll() is None, agent.stdout.read()
        train = start_train("e2e-wf", "--steps", "1500", "--step-sleep", "0.005")
        wait_for(lambda: _has_steps(store, "e2e-wf"), timeout=90)
        capsys.readouterr()
        assert run(["profile", "e2e-wf", "--steps", "5", "--timeout", "90"]) == 0
        printed = capsys.readouterr().out.strip().splitlines()
        summary = finish(train)
    finally:
        if train is not None and train.poll() is None:
            train.kill()
        agent.terminate()
        agent.wait(timeout=60)
    assert summary["end_step"] == 1500  # profiling did not cost the job a step
    with store.session() as s:
        trace = s.scalar(select(Trace).where(Trace.workflow_id == "e2e-wf"))
        request = profiling.get_request(s, trace.profile_request_id)
    assert printed == [trace.path] and summary["traces"] == [trace.path]
    assert (request.status, trace.host_id, trace.rank, trace.steps) == ("done", "e2e-host", 0, 5)
    data = trace_events(trace.path)
    assert data["distributedInfo"]["rank"] == 0 and len(profiler_steps(data)) == 5
    assert data["fleetlens"]["request_id"] == request.id
    load_with_hta(Path(trace.path).parent, 0)
    store.dispose()


def _has_steps(store: Store, workflow: str) -> bool:
    with store.session() as s:
        return s.scalar(select(StepStat.id).where(StepStat.workflow_id == workflow).limit(1)) is not None
