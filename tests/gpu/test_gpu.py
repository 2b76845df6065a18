"""On a GPU host (skipped elsewhere, with the reason): the NVML source on a real device, two lane-mates whose
kernels never overlap (from profiler traces of both), a memory share enforced, and the demo end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select

from collector.sdk_handlers import SdkHandlers
from collector.socket_server import SocketServer
from collector.sources import open_source
from collector.sources.nvml import NvmlSource
from enforcer.gate import LaneGate
from store.db import Store
from store.migrations import upgrade
from store.models import Device, Host, ProcessSample, StepStat
from store.settings import Settings, get_settings
from tests.conftest import PROJECT_ROOT
from tests.gpu.traces import kernel_spans, overlap_fraction

pytestmark = pytest.mark.gpu
MiB = 1 << 20
FLEETLENS = str(Path(sys.executable).with_name("fleetlens"))


def _job_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETLENS_")}
    env.update({"PYTHONPATH": str(PROJECT_ROOT), "FLEETLENS_SDK_FLUSH_INTERVAL_S": "0.1"}, **extra)
    return env


@pytest.fixture
def gate_server(fleet_home: Path) -> Iterator[Settings]:
    """The agent's SDK side with the lane gate: SdkHandlers behind the real socket, on the home's SQLite."""
    settings = get_settings(fresh=True)
    settings.ensure_home()
    store = Store.from_settings(settings)
    upgrade(store)
    handlers = SdkHandlers(store, "gpu-host", settings, sync_interval_s=0.2)
    handlers.gate = LaneGate("fifo")
    server = SocketServer(settings.socket_path, handlers).start()
    yield settings
    server.stop()
    handlers.close()
    store.dispose()


def test_the_nvml_source_reads_a_real_device_and_this_process_on_it() -> None:
    import torch  # a CUDA allocation is what the source must see

    src = NvmlSource()
    try:
        infos = src.devices()
        assert infos and all(d.uuid.startswith(("GPU-", "MIG-")) and d.memory_total > 0 for d in infos)
        before = sum(r.mem_used or 0 for r in src.sample())
        held = torch.ones(512 * MiB // 4, device="cuda")  # written: resident on the device
        torch.cuda.synchronize()
        deadline = time.monotonic() + 30
        while True:
            readings = src.sample()
            mine = [p for r in readings for p in r.processes if p.pid == os.getpid()]
            if sum(r.mem_used or 0 for r in readings) - before >= 400 * MiB:
                break
            assert time.monotonic() < deadline, "NVML never showed this process's 512 MiB"
            time.sleep(0.2)
        assert all(not r.lost and r.mem_total and 0.0 <= (r.gpu_util or 0.0) <= 1.0 for r in readings)
        # in a container NVML may list processes by pids of another namespace; when it lists ours, it has the memory
        assert all(p.mem_used is None or p.mem_used >= 400 * MiB for p in mine)
        del held
    finally:
        src.close()
    source = open_source(Settings(source="auto"))
    try:
        assert source.name == "nvml"  # auto picks NVML on a GPU host
    finally:
        source.close()


@pytest.mark.slow
def test_two_lane_mates_kernels_do_not_overlap(gate_server: Settings, tmp_path: Path) -> None:
    traces = {name: tmp_path / f"{name}.json" for name in ("mate-a", "mate-b")}
    procs = {name: subprocess.Popen([sys.executable, "-m", "tests.gpu.lane_job", "--trace", str(path)],
                                    env=_job_env(FLEETLENS_HOME=str(gate_server.home), FLEETLENS_LANE="1",
                                                 FLEETLENS_WORKFLOW=name),
                                    cwd=PROJECT_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, path in traces.items()}
    try:
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=600)
            assert proc.returncode == 0, f"{name}: {err[-3000:]}"
            summary = json.loads(out.strip().splitlines()[-1])
            assert summary["connected"] and summary["steps"] == 40, summary
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    a, b = (kernel_spans(traces[name]) for name in ("mate-a", "mate-b"))
    assert len(a[0]) and len(b[0]), "a trace has no kernels"
    # the two jobs ran at the same time (their spans interleave), yet their kernels never did
    assert a[0].min() < b[1].max() and b[0].min() < a[1].max()
    assert overlap_fraction(a, b) <= 0.01


def test_a_memory_share_is_enforced(fleet_home: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "tests.gpu.share_job"],
                          env=_job_env(FLEETLENS_HOME=str(fleet_home), FLEETLENS_WORKFLOW="gpu-share",
                                       FLEETLENS_MEMORY_FRACTION="0.05"),
                          cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["applied"] == 0.05
    assert result["beyond_refused"] is True, result  # 1.5 shares: refused...
    assert result["steps"] == 2 and result["reserved"] <= result["share"]  # ...and the job went on within it


@pytest.mark.slow
def test_the_demo_runs_end_to_end_on_the_gpu(tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETLENS_")}
    env.update({"FLEETLENS_HOME": str(home), "FLEETLENS_SECRET": "demo-gpu-secret"})
    result = subprocess.run([FLEETLENS, "demo", "--no-ui", "--duration", "90"], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=900)
    summary = json.loads((home / "demo" / "demo-summary.json").read_text())
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert summary["steps_failed"] == []
    jobs = {job["workflow"] for job in summary["jobs"].values()}
    store = Store(summary["db_url"])
    try:
        with store.session() as s:
            nvml_hosts = set(s.scalars(select(Host.id).where(Host.source == "nvml")))
            assert nvml_hosts, "the demo's agent did not sample the GPU"
            gpus = set(s.scalars(select(Device.id).where(Device.source == "nvml")))
            for wf in jobs:
                assert s.scalar(select(StepStat.id).where(StepStat.workflow_id == wf).limit(1)), wf
                # the job held memory on a GPU: its CUDA context at least, seen by NVML
                on_gpu = s.scalar(select(ProcessSample.ts).where(
                    ProcessSample.workflow_id == wf, ProcessSample.device_id.in_(gpus),
                    ProcessSample.mem_used > 0).limit(1))
                assert on_gpu is not None, f"{wf} never showed on a GPU"
    finally:
        store.dispose()
