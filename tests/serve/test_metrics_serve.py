"""`fleetlens metrics-serve` as a real process, scraped by a real Prometheus: the analyzer's and the enforcer's numbers.

The store holds 16 containers of the Alibaba GenAI recording, the detectors' findings over them, one plan that
frees 3 devices, and two migrations.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from sqlalchemy import func, select

from analyzer.ranking import costed, findings_frame, rank_teams, rank_with_waste, rank_workflows
from analyzer.telemetry import detect
from collector.agent import Agent
from collector.recordings.load import load_into_store
from collector.sources.nvml import NvmlSource
from store.db import Store
from store.migrations import upgrade
from store.models import Action, Plan, ProcessSample
from store.settings import Settings
from tests.conftest import FLEET, PROJECT_ROOT
from tests.fakes.fake_pynvml import FakeGPU, FakeNVML, FakeProcess, GiB
from tests.prometheus_server import PROMTOOL, free_port, prometheus
from ui.serve.processes import fleetlens_command, processes_of

MARK = "FLEETLENS_TEST_METRICS_SERVE"


@pytest.fixture
def fleet(fleet_home: Path) -> Iterator[tuple[Store, float]]:
    fleet_home.mkdir(parents=True, exist_ok=True)
    store = Store(f"sqlite:///{fleet_home / 'fleetlens.db'}")
    upgrade(store)
    now = time.time()
    load_into_store(store, FLEET, containers=16, end_at=now)
    assert detect(store, now=now, window_s=86400.0)
    with store.session() as s:
        s.add(Plan(created_at=now, policy="pack", applied=False, devices_freed=3, moves=[], summary={}))
        wf = findings_frame(store)["workflow_id"].iloc[0]
        for state in ("resumed", "failed"):
            s.add(Action(workflow_id=wf, state=state, created_at=now, updated_at=now))
    yield store, now
    store.dispose()


@pytest.fixture
def exporter(fleet, fleet_home: Path) -> Iterator[int]:
    port, token = free_port(), uuid.uuid4().hex
    env = {**os.environ, "FLEETLENS_METRICS_SERVE_REFRESH_S": "1", MARK: token}
    log = open(fleet_home / "metrics.log", "wb")
    proc = subprocess.Popen(fleetlens_command("metrics-serve", "--listen-address", f"127.0.0.1:{port}",
                                              "--duration", "120"),
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 180
        while True:  # ready once it answers
            assert proc.poll() is None, (fleet_home / "metrics.log").read_text()
            try:
                httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "metrics-serve did not start"
                time.sleep(0.2)
        # it listens where --listen-address says, not on every interface
        listening = {c.laddr for c in psutil.Process(proc.pid).net_connections("inet") if c.status == "LISTEN"}
        assert listening == {("127.0.0.1", port)}, listening
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
        left = []
        for p in psutil.process_iter(["pid"]):
            try:
                if p.environ().get(MARK) == token:
                    left.append(p.pid)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        assert not left, left


@pytest.mark.slow
def test_prometheus_scrapes_the_fleet_exporter(fleet, exporter: int, tmp_path: Path) -> None:
    store, now = fleet
    with prometheus(tmp_path / "prom", targets=[f"127.0.0.1:{exporter}"]) as prom:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not prom.query("fleetlens_workflow_recoverable_gpus"):
            time.sleep(0.5)
        # GPUs (GPU-seconds per second): 24 times that is the ranking's GPU-hours per day
        per_wf = {s["metric"]["workflow"]: 24 * float(s["value"][1])
                  for s in prom.query("fleetlens_workflow_recoverable_gpus")}
        per_team = {s["metric"]["team"]: 24 * float(s["value"][1])
                    for s in prom.query("fleetlens_team_recoverable_gpus")}
        per_rule = {(s["metric"]["workflow"], s["metric"]["rule"]): 24 * float(s["value"][1])
                    for s in prom.query("fleetlens_recoverable_gpus")}
        severity = {(s["metric"]["severity"], s["metric"]["rule"]): float(s["value"][1])
                    for s in prom.query("fleetlens_open_findings")}
        devices = {s["metric"]["state"]: float(s["value"][1]) for s in prom.query("fleetlens_devices")}
        migrations = {s["metric"]["state"]: float(s["value"][1]) for s in prom.query("fleetlens_migrations")}
    ranked = rank_workflows(store, now=now)
    ranked = ranked[ranked["open_findings"] > 0]
    assert per_wf == pytest.approx(dict(zip(ranked["workflow_id"], ranked["recoverable_gpu_hours_per_day"],
                                            strict=True)), abs=1e-6)
    teams = rank_teams(store, now=now)
    assert per_team == pytest.approx(dict(zip(teams["team"], teams["recoverable_gpu_hours_per_day"], strict=True)),
                                     abs=1e-6)
    findings = findings_frame(store)
    cost = costed(findings, rank_with_waste(store, now=now)[1])  # each finding's cost from the one waste function
    assert per_rule == pytest.approx(cost.groupby(["workflow_id", "rule"])["gpu_hours_per_day"].sum().to_dict(),
                                     abs=1e-6)
    assert severity == findings.groupby(["severity", "rule"]).size().astype(float).to_dict()
    with store.session() as s:
        last = [t for (t,) in s.execute(select(func.max(ProcessSample.ts)).group_by(ProcessSample.device_id))]
    # held: a process sample in the last 15 minutes (none ends near that edge, so the scrape's clock cannot matter)
    assert not [t for t in last if now - 960 < t < now - 840]
    held = sum(t >= now - 900 for t in last)
    assert 0 < held < 16  # some of the 16 containers finished earlier in the day
    assert devices == {"held": held, "needed": held - 3, "freed": 3.0}
    assert migrations == {"resumed": 1.0, "failed": 1.0}


BOARD = PROJECT_ROOT / "docs" / "grafana" / "fleetlens.json"
NO_LANES = {"fleetlens_gate_waiting_jobs", "fleetlens_lane_member"}  # this store has no lanes: declared, no series


@pytest.fixture
def agent(fleet, fleet_home: Path) -> Iterator[Agent]:
    """An agent with two fake GPUs; this test's own process runs on GPU 0 as a workflow of the store."""
    store, _ = fleet
    workflow = findings_frame(store)["workflow_id"].iloc[0]
    fake = FakeNVML([FakeGPU(uuid="GPU-board-0", gpu_util=35, memory_used=20 * GiB,
                             processes=[FakeProcess(pid=os.getpid(), used_memory=20 * GiB, sm_util=35)]),
                     FakeGPU(uuid="GPU-board-1")])
    settings = Settings(home=fleet_home, secret="t", host_id="board-host", metrics_port=free_port(),
                        metrics_host="127.0.0.1")
    a = Agent(store, settings, NvmlSource(nvml=fake), sample_interval_s=0.2, flush_interval_s=1.0,
              serve_socket=False, attribute=lambda pid: (workflow, "env"))
    a.start()
    try:
        yield a
    finally:
        a.stop()


def _metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\b(DCGM_FI_[A-Z_]+|fleetlens_[a-z_]+)\b", expr))


@pytest.mark.slow
def test_the_grafana_board_queries_what_the_exporters_publish(agent: Agent, exporter: int, tmp_path: Path) -> None:
    board = json.loads(BOARD.read_text())
    targets = [(p["title"], t["expr"]) for p in board["panels"] for t in p["targets"]]
    assert len(targets) == len(board["panels"]) >= 10
    declared = "\n".join(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
                         for port in (agent.metrics_port, exporter))
    for title, expr in targets:
        for name in _metric_names(expr):
            assert f"# TYPE {name} " in declared, (title, name)
    with prometheus(tmp_path / "prom", targets=[f"127.0.0.1:{agent.metrics_port}", f"127.0.0.1:{exporter}"]) as prom:
        deadline = time.monotonic() + 180
        empty = targets
        while empty and time.monotonic() < deadline:
            empty = [(title, expr) for title, expr in targets
                     if not _metric_names(expr) & NO_LANES and not prom.query(expr.replace("$team", ".*"))]
            time.sleep(0.5)
    assert not empty, empty


@pytest.mark.slow
def test_serve_starts_the_fleet_exporter_and_stops_it(tmp_path: Path) -> None:
    home = tmp_path / "home"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETLENS_")}
    env.update({"FLEETLENS_HOME": str(home), "FLEETLENS_SECRET": "serve-test",
                "FLEETLENS_METRICS_SERVE_PORT": str(port)})
    serve = subprocess.Popen(fleetlens_command("serve", "--no-ui", "--no-agent"), env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        exported = ""
        deadline = time.monotonic() + 240  # a fleetlens process of its own: a busy machine takes a while to start it
        while "fleetlens_store_up 1.0" not in exported and time.monotonic() < deadline and serve.poll() is None:
            try:
                exported = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
            except httpx.HTTPError:
                time.sleep(0.5)
        serve.terminate()
        out, _ = serve.communicate(timeout=120)
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
    assert "fleetlens_store_up 1.0" in exported and "# TYPE fleetlens_devices gauge" in exported, out
    assert f"fleet metrics at http://127.0.0.1:{port}/metrics" in out
    assert list(processes_of(home)) == []  # the exporter stopped with serve


@pytest.mark.slow
def test_promtool_finds_both_expositions_clean(agent: Agent, exporter: int) -> None:
    """`promtool check metrics` on metrics-serve's and the agent's /metrics: nothing to say of the first; of the
    second only dcgm-exporter's own `modelName` label (kept on purpose: boards built for dcgm-exporter group by it).
    Each device's DCGM series appears once; the workflows on it are series of their own."""
    deadline = time.monotonic() + 60
    while True:
        text = httpx.get(f"http://127.0.0.1:{agent.metrics_port}/metrics", timeout=10).text
        if "fleetlens_device_workflow{" in text or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert agent._metrics_server.server_address[0] == "127.0.0.1"  # FLEETLENS_METRICS_HOST, not every interface
    fleet = httpx.get(f"http://127.0.0.1:{exporter}/metrics", timeout=10).text
    assert "fleetlens_team_recoverable_gpus{" in fleet
    checked = subprocess.run([PROMTOOL, "check", "metrics"], input=fleet, capture_output=True, text=True, timeout=60)
    assert (checked.returncode, checked.stdout + checked.stderr) == (0, "")
    checked = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    problems = [line for line in (checked.stdout + checked.stderr).splitlines() if line.strip()]
    allowed = "label names should be written in 'snake_case' not 'camelCase'"
    assert problems and [p for p in problems if not (p.startswith("DCGM_FI_") and p.endswith(allowed))] == []
    assert ' modelName="' not in text and 'modelName="' in text
    util = [line for line in text.splitlines() if line.startswith("DCGM_FI_DEV_GPU_UTIL{")]
    assert len(util) == 2 and not [line for line in util if "workflow=" in line]  # one per GPU, no workflow
    users = [line for line in text.splitlines() if line.startswith("fleetlens_device_workflow{")]
    assert len(users) == 1 and 'UUID="GPU-board-0"' in users[0] and 'hostname="board-host"' in users[0]


def test_listen_addresses_are_read_as_dcgm_exporter_writes_them(fleet_home: Path) -> None:
    from store.errors import InvalidInput
    from ui.cli.prometheus import parse_listen_address

    assert parse_listen_address(":9400") == ("", 9400)
    assert parse_listen_address("127.0.0.1:9108") == ("127.0.0.1", 9108)
    assert parse_listen_address("[::1]:9400") == ("::1", 9400)
    for bad in ("9400", "host:", "a:b:9400", ":70000"):
        with pytest.raises(InvalidInput, match="not \\[HOST\\]:PORT"):
            parse_listen_address(bad)


def test_metrics_serve_on_a_port_already_taken_says_so_in_one_line(sqlite_store: Store) -> None:
    import socket

    from store.errors import ConfigError
    from ui.serve.metrics import serve_fleet_metrics

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"cannot serve /metrics on 127.0.0.1:{port} .*--listen-address"):
            serve_fleet_metrics(sqlite_store, Settings(), port=port, addr="127.0.0.1", duration=0.1)
