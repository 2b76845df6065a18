"""Claims on traces under `fleetlens serve` (one host, no Airflow to retry): a trace a killed run left 'analyzing' is
taken up again by the next run once its claim lapses, a live run's trace is never taken by another, and a trace that
kills its analyser every time is failed after FLEETLENS_TRACE_MAX_ATTEMPTS claims."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from sqlalchemy import func, select

import analyzer.traces.jobs as jobs
from analyzer import periodic
from analyzer.traces import register_trace
from analyzer.traces.claims import ClaimPolicy
from store.db import Store
from store.models import Finding, Trace
from store.settings import Settings, get_settings
from tests.conftest import PROJECT_ROOT, TRACES

TRACE = TRACES / "a100_alexnet_microbench.json.gz"
LEASE_S = 0.5  # short, so that a dead run's claim lapses within the test

# one run of serve's trace job in a process of its own, killed outright (SIGKILL, as the OOM killer does) once the
# analysis of the trace it claimed has begun
KILLED_RUN = """
import os, signal
import analyzer.traces.jobs as jobs
from analyzer import periodic
from store.db import Store
from store.settings import get_settings
jobs.analyze_one = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)
settings = get_settings()
periodic.analyze_traces(Store.from_settings(settings), settings)
"""


@pytest.fixture
def serve_settings(any_store: Store, fleet_home: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    """The settings serve's jobs run with, on the test's store (for the runs in other processes too)."""
    fleet_home.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("FLEETLENS_DB_URL", any_store.url.render_as_string(hide_password=False))
    monkeypatch.setenv("FLEETLENS_TRACE_CLAIM_TIMEOUT_S", str(LEASE_S))
    return get_settings(fresh=True)


def killed_run() -> int:
    """Run serve's trace job in a child killed mid-analysis; its exit code."""
    return subprocess.run([sys.executable, "-c", KILLED_RUN], env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT)},
                          timeout=120).returncode


def wait_for_lapse(store: Store, trace_id: int, lease_s: float) -> None:
    """Until the trace's claim has gone a whole lease without renewal (its run is dead: nothing renews it)."""
    while True:
        with store.session() as s:
            renewed = s.get(Trace, trace_id).claimed_at
        if renewed is None or time.time() > renewed + lease_s:
            return
        time.sleep(0.05)


def trace(store: Store, trace_id: int) -> Trace:
    with store.session() as s:
        return s.get(Trace, trace_id)


def findings_of(store: Store, trace_id: int) -> int:
    with store.session() as s:
        return s.scalar(select(func.count()).select_from(Finding).where(Finding.trace_id == trace_id))


def test_a_trace_a_killed_run_left_analyzing_is_analysed_by_the_next_run(any_store, serve_settings) -> None:
    trace_id = register_trace(any_store, TRACE, workflow_id="wf-killed")
    assert killed_run() == -signal.SIGKILL
    assert trace(any_store, trace_id).status == "analyzing"  # left mid-way by the killed run
    wait_for_lapse(any_store, trace_id, LEASE_S)
    assert periodic.analyze_traces(any_store, serve_settings) == {"analyzed": 1, "failed": 0}
    done = trace(any_store, trace_id)
    assert (done.status, done.error) == ("analyzed", None) and done.summary["n_steps"] > 0
    assert findings_of(any_store, trace_id) > 0
    assert periodic.analyze_traces(any_store, serve_settings) == {"analyzed": 0, "failed": 0}  # done once


def test_a_trace_a_live_run_analyses_is_never_taken_by_another(any_store, serve_settings, monkeypatch) -> None:
    lease_s = 1.0
    monkeypatch.setenv("FLEETLENS_TRACE_CLAIM_TIMEOUT_S", str(lease_s))
    settings = get_settings(fresh=True)
    trace_id = register_trace(any_store, TRACE, workflow_id="wf-live")
    real, calls, release = jobs.analyze_one, [], threading.Event()

    def analyze_one(*args, **kwargs):  # the first analysis takes as long as the test holds it
        calls.append(threading.current_thread().name)
        if len(calls) == 1:
            assert release.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(jobs, "analyze_one", analyze_one)
    first: dict = {}
    live = threading.Thread(target=lambda: first.update(periodic.analyze_traces(any_store, settings)), name="live")
    live.start()
    try:
        while not calls:  # the live run has claimed the trace and is analysing it
            time.sleep(0.02)
        claimed_at = time.time()
        while time.time() < claimed_at + 2 * lease_s:  # longer than a lease: only its renewals keep the claim
            time.sleep(0.05)
        # serve's other trace job, an Airflow batch on another worker, and an explicit analysis all leave it alone
        assert periodic.analyze_traces(any_store, settings) == {"analyzed": 0, "failed": 0}
        assert periodic.analyze_trace_batch(any_store, settings, [trace_id]) == {
            "analyzed": [], "failed": [], "skipped": [trace_id]}
        assert periodic.trace_batches(any_store, settings) == []
        by_hand = jobs.analyze_trace(any_store, trace_id, cache_dir=settings.home / "cache" / "traces",
                                     claims=ClaimPolicy.from_settings(settings))
        assert by_hand["status"] == "skipped" and "being analysed by another run" in by_hand["error"]
        assert trace(any_store, trace_id).status == "analyzing"
    finally:
        release.set()
        live.join(60)
    assert first == {"analyzed": 1, "failed": 0}
    assert calls == ["live"]  # analysed once, by the run that claimed it
    done = trace(any_store, trace_id)
    assert (done.status, done.error) == ("analyzed", None) and findings_of(any_store, trace_id) > 0


def test_a_trace_that_kills_its_analyser_every_time_is_failed_after_the_attempts(any_store, serve_settings,
                                                                                   monkeypatch) -> None:
    monkeypatch.setenv("FLEETLENS_TRACE_MAX_ATTEMPTS", "2")
    settings = get_settings(fresh=True)
    trace_id = register_trace(any_store, TRACE, workflow_id="wf-oom")
    for attempt in (1, 2):  # the first claim, then the retake of the dead run's lapsed one: both killed
        assert killed_run() == -signal.SIGKILL, attempt
        left = trace(any_store, trace_id)
        assert (left.status, left.attempts, left.error) == ("analyzing", attempt, None)
        assert left.claim_token and left.claimed_at is not None
        wait_for_lapse(any_store, trace_id, LEASE_S)
    assert periodic.analyze_traces(any_store, settings) == {"analyzed": 0, "failed": 1}
    failed = trace(any_store, trace_id)
    assert failed.status == "failed" and "started 2 times and never finished" in failed.error
    assert str(TRACE.resolve()) in failed.error and "FLEETLENS_TRACE_MEMORY_MB" in failed.error  # the path registered
    assert periodic.analyze_traces(any_store, settings) == {"analyzed": 0, "failed": 0}  # given up for good
    assert periodic.trace_batches(any_store, settings) == []


def test_a_run_stopped_by_ctrl_c_gives_the_trace_back_without_counting_an_attempt(any_store, serve_settings,
                                                                                  monkeypatch) -> None:
    monkeypatch.setenv("FLEETLENS_TRACE_MAX_ATTEMPTS", "2")
    settings = get_settings(fresh=True)
    trace_id = register_trace(any_store, TRACE, workflow_id="wf-interrupted")
    real = jobs.analyze_one

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(jobs, "analyze_one", interrupted)
    with pytest.raises(KeyboardInterrupt):
        periodic.analyze_traces(any_store, settings)
    back = trace(any_store, trace_id)
    assert (back.status, back.attempts, back.claim_token, back.claimed_at) == ("registered", 0, None, None)

    # a killed run's claim (one attempt), retaken by a run that is then stopped: the row goes back to the killed
    # run's lapsed claim, so only the kill counts, and the next run still gets its second attempt
    assert killed_run() == -signal.SIGKILL
    killed = trace(any_store, trace_id)
    assert (killed.status, killed.attempts) == ("analyzing", 1)
    wait_for_lapse(any_store, trace_id, LEASE_S)
    with pytest.raises(KeyboardInterrupt):
        periodic.analyze_traces(any_store, settings)
    back = trace(any_store, trace_id)
    assert (back.status, back.attempts, back.claim_token, back.claimed_at) == (
        "analyzing", 1, killed.claim_token, killed.claimed_at)
    monkeypatch.setattr(jobs, "analyze_one", real)
    assert periodic.analyze_traces(any_store, settings) == {"analyzed": 1, "failed": 0}
    done = trace(any_store, trace_id)
    assert (done.status, done.attempts, done.error) == ("analyzed", 2, None) and findings_of(any_store, trace_id) > 0


def test_a_ctrl_c_during_a_new_analysis_leaves_the_earlier_result_standing(any_store, serve_settings,
                                                                           monkeypatch) -> None:
    trace_id = register_trace(any_store, TRACE, workflow_id="wf-again")
    assert periodic.analyze_traces(any_store, serve_settings) == {"analyzed": 1, "failed": 0}
    before, found = trace(any_store, trace_id), findings_of(any_store, trace_id)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(jobs, "analyze_one", interrupted)
    with pytest.raises(KeyboardInterrupt):
        jobs.analyze_trace(any_store, trace_id, cache_dir=serve_settings.home / "cache" / "traces",
                           claims=ClaimPolicy.from_settings(serve_settings))
    after = trace(any_store, trace_id)
    assert (after.status, after.error, after.attempts, after.claim_token) == ("analyzed", None, before.attempts, None)
    assert after.summary == before.summary and findings_of(any_store, trace_id) == found > 0


@contextmanager
def hung_run(store: Store, settings: Settings, trace_id: int, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict]:
    """A run of serve's trace job whose analysis hangs (a read stuck on a dead mount) in a thread named "hung", until
    it has noted why and let its claim lapse; yields {"calls": threads that called the analysis, "noted": the row
    then, "result": the hung run's result once the block ends}, and lets the analysis go on when the block ends."""
    real, calls, release = jobs.analyze_one, [], threading.Event()

    def analyze_one(*args, **kwargs):  # the first analysis hangs; later ones run
        calls.append(threading.current_thread().name)
        if len(calls) == 1:
            assert release.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(jobs, "analyze_one", analyze_one)
    out: dict = {"calls": calls, "result": {}}
    thread = threading.Thread(target=lambda: out["result"].update(periodic.analyze_traces(store, settings)),
                              name="hung")
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not trace(store, trace_id).error:
            assert time.monotonic() < deadline, "the hung run never noted why its claim lapses"
            time.sleep(0.05)
        out["noted"] = trace(store, trace_id)
        wait_for_lapse(store, trace_id, LEASE_S)
        yield out
    finally:
        release.set()
        thread.join(60)


def test_a_hung_run_lets_its_claim_lapse_and_the_next_run_analyses_the_trace(any_store, serve_settings,
                                                                            monkeypatch) -> None:
    monkeypatch.setenv("FLEETLENS_TRACE_ANALYSIS_MAX_S", "1")
    settings = get_settings(fresh=True)
    trace_id = register_trace(any_store, TRACE, workflow_id="wf-hung")
    with hung_run(any_store, settings, trace_id, monkeypatch) as hung:
        assert hung["noted"].status == "analyzing" and "FLEETLENS_TRACE_ANALYSIS_MAX_S" in hung["noted"].error
        assert periodic.analyze_traces(any_store, settings) == {"analyzed": 1, "failed": 0}
    assert hung["calls"] == ["hung", "MainThread"]
    assert hung["result"] == {"analyzed": 0, "failed": 0}  # its late result was dropped: the trace is the next run's
    done = trace(any_store, trace_id)
    assert (done.status, done.error, done.attempts) == ("analyzed", None, 2) and findings_of(any_store, trace_id) > 0


def test_a_trace_whose_analysis_hangs_every_time_is_failed_with_that_reason(any_store, serve_settings,
                                                                           monkeypatch) -> None:
    monkeypatch.setenv("FLEETLENS_TRACE_ANALYSIS_MAX_S", "1")
    monkeypatch.setenv("FLEETLENS_TRACE_MAX_ATTEMPTS", "1")
    settings = get_settings(fresh=True)
    trace_id = register_trace(any_store, TRACE, workflow_id="wf-hangs")
    with hung_run(any_store, settings, trace_id, monkeypatch) as hung:
        assert periodic.analyze_traces(any_store, settings) == {"analyzed": 0, "failed": 1}
    failed = trace(any_store, trace_id)
    assert failed.status == "failed" and "started 1 times and never finished" in failed.error
    assert "s without finishing and stopped renewing" in failed.error
    assert "FLEETLENS_TRACE_ANALYSIS_MAX_S" in failed.error and "FLEETLENS_TRACE_MEMORY_MB" not in failed.error
    assert hung["calls"] == ["hung"]


# `fleetlens serve` whose trace job is in the middle of an analysis when it is stopped
SERVE_MID_ANALYSIS = """
import sys, time
import analyzer.traces.jobs as jobs
def analyze_one(*args, **kwargs):
    time.sleep(600)
jobs.analyze_one = analyze_one
from ui.cli import main
sys.argv = ["fleetlens", "serve", "--no-ui", "--no-agent", "--no-metrics"]
main()
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_serve_stopped_mid_analysis_gives_the_trace_back(any_store, serve_settings, sig, tmp_path) -> None:
    trace_id = register_trace(any_store, TRACE, workflow_id="wf-serve-stopped")
    log = tmp_path / "serve.log"
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", SERVE_MID_ANALYSIS], env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while trace(any_store, trace_id).status != "analyzing":
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        proc.send_signal(sig)
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 128 + sig, log.read_text()[-3000:]
    back = trace(any_store, trace_id)
    assert (back.status, back.attempts, back.claim_token, back.claimed_at) == ("registered", 0, None, None)
