"""The `gpu` tests' trace helpers on real recorded traces (no GPU needed): kernel spans on one clock, overlap."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pynvml
import pytest

from tests.conftest import PROJECT_ROOT, TRACES
from tests.gpu.probe import gpu_unavailable_reason
from tests.gpu.traces import kernel_spans, overlap_fraction, overlap_us


def test_kernel_spans_are_on_the_wall_clock_and_merged() -> None:
    starts, ends = kernel_spans(TRACES / "a100_2rank_nccl.json.gz")  # has baseTimeNanoseconds
    assert len(starts) > 10 and np.all(ends >= starts) and np.all(starts[1:] > ends[:-1])
    assert 1.5e9 < starts[0] / 1e6 < 1.9e9  # epoch seconds of the 2020s, not microseconds since boot
    # no base: the times are taken as written (this older trace writes epoch microseconds itself)
    raw_starts, _ = kernel_spans(TRACES / "a100_alexnet_microbench.json.gz")
    assert len(raw_starts) > 0 and 1.5e9 < raw_starts[0] / 1e6 < 1.9e9


def test_overlap_of_a_job_with_itself_is_all_and_with_a_later_copy_none() -> None:
    spans = kernel_spans(TRACES / "a100_alexnet_microbench.json.gz")
    total = float((spans[1] - spans[0]).sum())
    assert overlap_us(spans, spans) == pytest.approx(total)
    assert overlap_fraction(spans, spans) == pytest.approx(1.0)
    later = (spans[0] + 1e9, spans[1] + 1e9)
    assert overlap_us(spans, later) == 0.0 and overlap_fraction(spans, later) == 0.0


def test_overlap_counts_only_the_shared_time() -> None:
    a = (np.array([0.0, 10.0]), np.array([4.0, 14.0]))
    b = (np.array([2.0, 20.0]), np.array([12.0, 21.0]))
    assert overlap_us(a, b) == pytest.approx(2.0 + 2.0)
    assert overlap_fraction(a, b) == pytest.approx(4.0 / 8.0)
    assert overlap_us(a, (np.empty(0), np.empty(0))) == 0.0


def test_the_gpu_probe_names_what_is_missing_or_nothing() -> None:
    import torch  # the probe's verdict, checked against torch and the real NVML directly

    reason = gpu_unavailable_reason()
    try:
        pynvml.nvmlInit()
        nvml_ok = True
        pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        nvml_ok = False
    if nvml_ok and torch.cuda.is_available():
        assert reason is None
    else:
        assert reason and ("NVML" in reason) == (not nvml_ok)
        assert ("torch.cuda.is_available() is False" in reason) == (not torch.cuda.is_available())


def test_the_lane_job_writes_a_trace_the_helpers_read(fleet_home, tmp_path) -> None:
    # the GPU test's job and trace path, run on the CPU: the loop, the SDK, the profiler's file, the parse
    trace = tmp_path / "cpu-mate.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETLENS_")}
    env.update(PYTHONPATH=str(PROJECT_ROOT), FLEETLENS_HOME=str(fleet_home), FLEETLENS_WORKFLOW="cpu-mate")
    proc = subprocess.run([sys.executable, "-m", "tests.gpu.lane_job", "--trace", str(trace), "--device", "cpu",
                           "--steps", "3", "--size", "64", "--matmuls", "2"], env=env, cwd=PROJECT_ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["steps"] == 3
    starts, ends = kernel_spans(trace)
    assert len(starts) == 0 and overlap_us((starts, ends), (starts, ends)) == 0.0  # no GPU, no kernels


def test_the_lane_job_says_it_reached_the_agent_while_its_job_is_open(fleet_home, tmp_path) -> None:
    # the summary is written inside the `with job(...)` block: read after it, `connected` would always be false
    from collector.sdk_handlers import SdkHandlers
    from collector.socket_server import SocketServer
    from enforcer.gate import LaneGate
    from store.db import Store
    from store.migrations import upgrade
    from store.settings import get_settings

    settings = get_settings(fresh=True)
    settings.ensure_home()
    store = Store.from_settings(settings)
    upgrade(store)
    handlers = SdkHandlers(store, "cpu-host", settings, sync_interval_s=0.2)
    handlers.gate = LaneGate("pack")
    server = SocketServer(settings.socket_path, handlers).start()
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETLENS_")}
        env.update(PYTHONPATH=str(PROJECT_ROOT), FLEETLENS_HOME=str(fleet_home), FLEETLENS_WORKFLOW="cpu-mate",
                   FLEETLENS_LANE="1")
        proc = subprocess.run([sys.executable, "-m", "tests.gpu.lane_job", "--trace", str(tmp_path / "t.json"),
                               "--device", "cpu", "--steps", "3", "--size", "64", "--matmuls", "2"], env=env,
                              cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300)
    finally:
        server.stop()
        handlers.close()
        store.dispose()
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["connected"] is True and summary["lane"] == "1" and summary["steps"] == 3
    assert handlers.gate.snapshot()["1"]["turns"] >= 3  # each step took its turn at the gate
