"""A running agent's /metrics, scraped by a real Prometheus: dcgm-exporter's names with fleetlens's labels, and back.

The agent samples two GPUs of the fake NVML; on them run three real processes (`sleep`) whose FLEETLENS_WORKFLOW
names their workflow, so the agent attributes them exactly as it would on a GPU host.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from sqlalchemy import select

from collector.agent import Agent
from collector.importers.prometheus import import_prometheus
from collector.sources.nvml import NvmlSource
from store.db import Store
from store.migrations import upgrade
from store.models import Device, DeviceSample, ProcessSample, Workflow
from store.settings import Settings
from store.workflows import upsert_workflow
from tests.fakes.fake_pynvml import FakeGPU, FakeNVML, FakeProcess, GiB
from tests.prometheus_server import free_port, prometheus
from ui.cli import run as cli

MARK = "FLEETLENS_TEST_AGENT_METRICS"
JOBS = {"wf-train": (0, 0), "wf-serve": (1, 1), "wf-eval": (1, 2)}  # workflow -> (gpu, process slot)


@pytest.fixture
def jobs() -> Iterator[dict[str, int]]:
    token = uuid.uuid4().hex
    procs = {wf: subprocess.Popen(["sleep", "300"], env={**os.environ, "FLEETLENS_WORKFLOW": wf, MARK: token})
             for wf in JOBS}
    try:
        yield {wf: p.pid for wf, p in procs.items()}
    finally:
        for p in procs.values():
            p.kill()
            p.wait(timeout=10)
        found = leftovers_of(token)
        assert not found, found


def leftovers_of(token: str) -> list[int]:
    out = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get(MARK) == token:
                out.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return out


def _fake(pids: dict[str, int]) -> FakeNVML:
    gpus = [FakeGPU(uuid=f"GPU-metrics-{g}", gpu_util=40 + g, memory_used=(10 + g) * GiB, power_mw=250_000,
                    processes=[]) for g in range(2)]
    for wf, (g, slot) in JOBS.items():
        gpus[g].processes.append(FakeProcess(pid=pids[wf], used_memory=(slot + 1) * GiB, sm_util=30 + slot))
    return FakeNVML(gpus)


@pytest.fixture
def agent(tmp_path: Path, jobs: dict[str, int]) -> Iterator[Agent]:
    settings = Settings(home=tmp_path / "home", secret="t", host_id="gpu-host-1", metrics_port=free_port())
    settings.ensure_home()
    store = Store(settings.resolved_db_url)
    upgrade(store)
    with store.session() as s:
        upsert_workflow(s, "wf-train", team="vision", labels={"pod": "train-0", "namespace": "vision"})
        upsert_workflow(s, "wf-serve", team="search")
    a = Agent(store, settings, NvmlSource(nvml=_fake(jobs)), sample_interval_s=0.2, flush_interval_s=1.0,
              serve_socket=False)
    a.start()
    try:
        yield a
    finally:
        a.stop()
        store.dispose()


def test_metrics_page_speaks_dcgm_exporter(agent: Agent) -> None:
    deadline = time.monotonic() + 120
    while not agent.latest and time.monotonic() < deadline:
        time.sleep(0.05)
    text = httpx.get(f"http://127.0.0.1:{agent.metrics_port}/metrics", timeout=10).text
    lines = [x for x in text.splitlines() if x.startswith("DCGM_FI_DEV_GPU_UTIL{")]
    assert len(lines) == 2  # one series per GPU, however many workflows use it (GPU 1 has two)
    line = next(x for x in lines if 'gpu="0"' in x)
    assert 'UUID="GPU-metrics-0"' in line and 'hostname="gpu-host-1"' in line and "workflow=" not in line
    assert line.endswith(" 40.0")  # percent, as dcgm-exporter
    users = [x for x in text.splitlines() if x.startswith("fleetlens_device_workflow{")]
    train = next(x for x in users if 'workflow="wf-train"' in x)
    assert len(users) == 3 and 'gpu="0"' in train and 'team="vision"' in train
    assert 'pod="train-0"' in train and 'namespace="vision"' in train and 'hostname="gpu-host-1"' in train
    assert 'DCGM_FI_DEV_FB_USED{' in text and "fleetlens_spool_batches{host=\"gpu-host-1\"} 0.0" in text



def test_a_new_sample_reaches_the_next_scrape(agent: Agent) -> None:
    """The formatted page is kept between samples, never past one: a reading that changed shows on the next scrape
    after the sampler took it."""
    url = f"http://127.0.0.1:{agent.metrics_port}/metrics"

    def util(text: str) -> str:
        line = next(x for x in text.splitlines() if x.startswith("DCGM_FI_DEV_GPU_UTIL{") and 'gpu="0"' in x)
        return line.rsplit(" ", 1)[1]

    deadline = time.monotonic() + 120
    while not agent.latest and time.monotonic() < deadline:
        time.sleep(0.05)
    assert util(httpx.get(url, timeout=10).text) == "40.0"
    agent.source.nvml.gpus[0].gpu_util = 77
    seen = agent.latest
    while agent.latest is seen and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.01)  # the sample of the round that replaced `seen` may have been read just before the change
    seen = agent.latest
    while agent.latest is seen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert util(httpx.get(url, timeout=10).text) == "77.0"

def test_prometheus_scrapes_the_agent_and_import_reads_it_back(agent: Agent, tmp_path: Path) -> None:
    with prometheus(tmp_path / "prom", targets=[f"127.0.0.1:{agent.metrics_port}"]) as prom:
        deadline = time.monotonic() + 180
        series: list[dict] = []
        while time.monotonic() < deadline:
            # each workflow's utilisation: its device's series joined with the device's users
            series = prom.query("DCGM_FI_DEV_GPU_UTIL * on (host, gpu) group_right fleetlens_device_workflow")
            if len({s["metric"].get("workflow") for s in series}) == 3:
                break
            time.sleep(0.5)
        by_wf = {s["metric"]["workflow"]: s for s in series}
        assert set(by_wf) == set(JOBS)
        train = by_wf["wf-train"]["metric"]
        assert (train["gpu"], train["UUID"], train["team"], train["pod"], train["namespace"], train["hostname"]) == (
            "0", "GPU-metrics-0", "vision", "train-0", "vision", "gpu-host-1")
        assert float(by_wf["wf-train"]["value"][1]) == 40.0
        assert len(prom.query("DCGM_FI_DEV_GPU_UTIL")) == 2
        others = [by_wf[w]["metric"] for w in ("wf-serve", "wf-eval")]
        # Prometheus drops empty labels: wf-eval has no team
        assert {(m["workflow"], m["gpu"], m.get("team", "")) for m in others} == {("wf-serve", "1", "search"),
                                                                                 ("wf-eval", "1", "")}
        mem = {s["metric"]["workflow"]: float(s["value"][1])
               for s in prom.query("fleetlens_process_gpu_memory_used_bytes")}
        assert mem == {"wf-train": 1.0 * GiB, "wf-serve": 2.0 * GiB, "wf-eval": 3.0 * GiB}
        # and back: the same Prometheus imported into another store gives the agent's devices and workflows,
        # once it holds a few scrapes (one scrape may fall between two of the import's one-second steps)
        while time.monotonic() < deadline and not prom.query("count_over_time(DCGM_FI_DEV_GPU_UTIL[1m]) >= 5"):
            time.sleep(0.5)
        other = Store(f"sqlite:///{tmp_path / 'other.db'}")
        upgrade(other)
        now = time.time()
        summary = import_prometheus(other, prom.url, since=now - 120, until=now, step=1.0,
                                    settings=Settings(home=tmp_path / "other"), now=now)
    try:
        assert summary.devices == 2 and summary.workflows == 3 and not summary.skipped
        with other.session() as s:
            devices = {(d.host_id, d.index): d.uuid for d in s.scalars(select(Device))}
            workflows = {w.id: w.team for w in s.scalars(select(Workflow))}
            util = s.scalars(select(DeviceSample.gpu_util)).first()
            proc_wfs = set(s.scalars(select(ProcessSample.workflow_id)))
        assert devices == {("gpu-host-1", 0): "GPU-metrics-0", ("gpu-host-1", 1): "GPU-metrics-1"}
        assert workflows == {"wf-train": "vision", "wf-serve": "search", "wf-eval": None}
        assert util in (pytest.approx(0.40), pytest.approx(0.41))
        assert proc_wfs == set(JOBS)
    finally:
        other.dispose()


def test_a_metrics_port_already_taken_is_one_line_not_a_traceback(cli_store, monkeypatch, capsys) -> None:
    """dcgm-exporter listens on :9400, the agent's default /metrics port: the agent says so and stops cleanly."""
    monkeypatch.setenv("FLEETLENS_SOURCE", "cpu")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = cli(["agent", "--listen-address", f"127.0.0.1:{port}", "--duration", "5"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert f"cannot serve /metrics on 127.0.0.1:{port} (Address already in use): is dcgm-exporter" in err
