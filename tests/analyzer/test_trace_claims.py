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
