"""SIGINT or SIGTERM in each phase of `fleetlens demo` (each signal in two phases, Ctrl-C while it migrates): it stops
everything it started (found by environment), says nothing is left, and exits 130 or 143; started the way a script
starts it (SIGINT ignored), too. The last phase, serving the dashboard, ends normally in tests/e2e/test_demo.py: a
run to reach it costs a whole demo, and what is running then (the dashboard beside the agent and the jobs) is stopped
by the same path."""

from __future__ import annotations

import json
import signal
import sqlite3
from pathlib import Path

import pytest

from tests.procs import processes_under
from tests.serve.stop_helpers import clean_env, start, stop, tail, wait_for

pytestmark = pytest.mark.slow


def _count(db: Path, sql: str) -> int:
    if not db.exists():
        return 0
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1) as conn:
        return conn.execute(sql).fetchone()[0]


# each phase, and how the test knows the demo is in it: what the demo's store shows
PHASES = {
    "jobs starting": "SELECT count(*) FROM commands WHERE kind = 'launch'",
    "replay loading": "SELECT count(*) FROM hosts WHERE source = 'replay'",
    "profiling": "SELECT count(*) FROM profile_requests",
    "migrating": "SELECT count(*) FROM actions",
}


def _run_until(tmp_path: Path, phase: str, sigint: str = "default"):
    home = tmp_path / "home"
    demo_home = home / "demo"
    log = tmp_path / "demo.log"
    proc = start(["demo", "--duration", "900", "--no-ui"], clean_env(home), log, sigint=sigint)
    sql = PHASES[phase]

    def reached() -> bool:
        # a demo step that failed (a plan with no move, on a machine too busy to tell the jobs apart) means the
        # later phases never come: say so at once rather than after the time-out
        assert "✗" not in tail(log, 50_000), f"the demo failed a step before {phase}:\n{tail(log)}"
        return bool(_count(demo_home / "fleetlens.db", sql))

    wait_for(phase, reached, proc, log, timeout=400)
    assert processes_under(demo_home), "the demo had started nothing yet"
    return proc, demo_home, log


def _assert_stopped(code: int, sig: int, demo_home: Path, log: Path) -> None:
    assert code == 128 + sig, tail(log)
    left = processes_under(demo_home)
    assert left == [], f"left running: {[p.pid for p in left]}"
    assert "nothing the demo started is still running" in tail(log, 20_000), tail(log)
    assert json.loads((demo_home / "demo-summary.json").read_text())["survivors"] == []


# One signal per phase, each signal in two phases: the handler is one for both signals (ui.serve.processes), so what a
# phase adds is what is running when it fires, not which signal it is. Each case is a demo run up to its phase, and the
# later phases cost most of a run (migrating about 90 s on two cores). SIGINT at "jobs starting" is the case below,
# where the demo starts with SIGINT ignored and must still take it.
CASES = [("jobs starting", signal.SIGTERM), ("replay loading", signal.SIGINT), ("profiling", signal.SIGTERM),
         ("migrating", signal.SIGINT)]
assert set(PHASES) == {phase for phase, _ in CASES}  # every phase is signalled


@pytest.mark.parametrize(("phase", "sig"), CASES,
                         ids=[f"{phase}-{signal.Signals(sig).name}" for phase, sig in CASES])
def test_a_signal_in_each_phase_stops_everything_the_demo_started(tmp_path, phase, sig):
    proc, demo_home, log = _run_until(tmp_path, phase)
    code, _ = stop(proc, sig, log)
    _assert_stopped(code, sig, demo_home, log)


def test_a_demo_started_ignoring_sigint_still_stops_on_it(tmp_path):
    """A script's background job inherits SIGINT ignored; the demo puts its own handler in place."""
    proc, demo_home, log = _run_until(tmp_path, "jobs starting", sigint="ignored")
    code, _ = stop(proc, signal.SIGINT, log)
    _assert_stopped(code, signal.SIGINT, demo_home, log)
