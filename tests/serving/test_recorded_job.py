"""The serving findings on a recorded serving job: a real early-exit torch model on the CPU behind the
distribution-aware request queue, recorded by the SDK's serving mode through a real agent into SQLite. Each rule
fires where it should and stays quiet where it should; every request is accounted for (served or shed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from analyzer.ranking import rank_with_waste
from analyzer.serving.rules import DYNAMIC_RUNTIME, OVER_PROVISIONED, SLO_MISSES, ServingThresholds, detect_serving
from store.findings import open_findings
from store.serving import app_windows
from tests.conftest import PROJECT_ROOT

pytestmark = pytest.mark.slow


def run_job(workflow: str, *args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT), "FLEETLENS_SDK_FLUSH_INTERVAL_S": "0.2"}
    # batches of one: a batch's time then varies only with its request (serving.dynamic_runtime judges the CV within
    # batch sizes, so varied sizes would not make the static application look dynamic either)
    proc = subprocess.run([sys.executable, "-m", "tests.serving.early_exit_job", "--workflow", workflow,
                           "--max-batch", "1", *args],
                          env=env, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_serving_findings_fire_and_stay_quiet_on_a_recorded_early_exit_job(agent) -> None:
    # tight: the dynamic app's SLO is 1.2 x its profiled median (many requests run longer alone), on one device
    tight = run_job("svc-tight", "--requests", "160", "--rate", "12", "--devices", "1", "--slo-dynamic", "1.2",
                    "--slo-static", "2000")
    # roomy: 3 s SLOs for both, light load, four devices held
    roomy = run_job("svc-roomy", "--requests", "160", "--rate", "12", "--devices", "4", "--slo-floor", "3",
                    "--slo-dynamic", "1", "--slo-static", "1")
    for out in (tight, roomy):
        assert out["served"] + out["shed"] == out["submitted"] == 160
        assert out["lost"] == 0 and out["sent"] == 160
    agent.handlers.flush()
    now = time.time() + 61
    with agent.store.session() as s:
        windows = {(w.workflow_id, w.app): w for w in app_windows(s, now - 3600, now)}
    # every request is in the store: served ones in n, shed ones in dropped
    for wf, out in (("svc-tight", tight), ("svc-roomy", roomy)):
        assert sum(w.n for k, w in windows.items() if k[0] == wf) == out["served"]
        assert sum(w.dropped for k, w in windows.items() if k[0] == wf) == out["shed"]
    assert windows[("svc-tight", "dynamic")].slo_s == pytest.approx(tight["slos"]["dynamic"])

    # enough served requests for the rules to judge (ServingThresholds.min_requests = 50)
    assert min(w.n for w in windows.values()) >= 50, {k: (w.n, w.dropped) for k, w in windows.items()}
    # The CPU time of identical work on this shared VM varies: 120 runs of the static app's layers, alone, gave a
    # quartile CV of 0.10-0.22 (fastest 0.6x the median), and a CI run under the other worker's load crossed the
    # default 0.3. GPU kernels do not vary so; here the threshold sits between that noise and the dynamic app's
    # ~1.0 (geometric exits: quartiles at 2, 5 and 9 layers), with room on both sides.
    th = ServingThresholds(cv_threshold=0.6)
    specs = detect_serving(agent.store, now=now, th=th)
    fired = {(f.rule, f.workflow_id, f.subject) for f in specs}
    assert (SLO_MISSES, "svc-tight", "dynamic") in fired
    assert (SLO_MISSES, "svc-tight", "static") not in fired
    assert not any(r == SLO_MISSES and wf == "svc-roomy" for r, wf, _ in fired)
    for wf in ("svc-tight", "svc-roomy"):
        assert (DYNAMIC_RUNTIME, wf, "dynamic") in fired
        assert (DYNAMIC_RUNTIME, wf, "static") not in fired
    assert (OVER_PROVISIONED, "svc-roomy", "serving") in fired
    assert (OVER_PROVISIONED, "svc-tight", "serving") not in fired  # one device, and missing its SLO

    over = next(f for f in specs if f.rule == OVER_PROVISIONED)
    assert over.evidence["held_devices"] == 4 and over.evidence["needed_devices"] < 4
    with agent.store.session() as s:
        stored = {(f.rule, f.workflow_id) for f in open_findings(s)}
    assert (OVER_PROVISIONED, "svc-roomy") in stored and (SLO_MISSES, "svc-tight") in stored
    # its GPU-hours go through the one waste function: the freed share of what the workflow holds
    _, waste = rank_with_waste(agent.store, now)
    row = waste.workflows.set_index("workflow_id").loc["svc-roomy"]
    share = over.evidence["cost_fraction"]
    assert row["recoverable_gpu_hours_per_day"] == pytest.approx(share * row["held_gpu_hours_per_day"])
    assert row["recoverable_gpu_hours_per_day"] <= row["held_gpu_hours_per_day"]


def test_a_real_serving_loop_gives_batches_up_at_their_stop_and_each_given_up_request_is_recorded_shed(agent) -> None:
    # the tight dynamic SLO again, with running batches stopped: the model asks the queue's clock between layers
    out = run_job("svc-stopping", "--requests", "160", "--rate", "12", "--devices", "1", "--slo-dynamic", "1.2",
                  "--slo-static", "2000", "--stop-running")
    assert out["served"] + out["shed"] == out["submitted"] == 160
    assert out["lost"] == 0 and out["sent"] == 160
    stops = out["stops"]
    assert out["stopped"] == len(stops) > 0  # batches of one: one request given up per stopped batch
    for stop in stops:
        # given up at its stop, not before, and short of the layers its request needed (run to its end, it would
        # not count as stopped). A stop may already be due when the loop takes its batch: the queue chose it a
        # moment earlier, and the loop then gives it up before its first layer.
        assert stop["stop_at"] <= stop["stopped"]
        assert stop["layers"] < stop["needed"]
    agent.handlers.flush()
    now = time.time() + 61
    with agent.store.session() as s:
        windows = [w for w in app_windows(s, now - 3600, now) if w.workflow_id == "svc-stopping"]
    assert sum(w.n for w in windows) == out["served"]
    assert sum(w.dropped for w in windows) == out["shed"] >= out["stopped"]
