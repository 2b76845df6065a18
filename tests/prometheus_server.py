"""A real Prometheus (Debian's /usr/bin/prometheus) for tests: own config, own data folder, a free port, always stopped.

Each server carries FLEETLENS_TEST_PROMETHEUS=<token> in its environment, so a test can prove by environment (not by
command line) that no server it started is left running.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import psutil
import pytest

PROMETHEUS, PROMTOOL = "/usr/bin/prometheus", "/usr/bin/promtool"
MARKER = "FLEETLENS_TEST_PROMETHEUS"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def need_prometheus() -> None:
    if not (os.access(PROMETHEUS, os.X_OK) and os.access(PROMTOOL, os.X_OK)):
        pytest.fail("Debian's prometheus package is not installed; `make prometheus` installs it")


def backfill(openmetrics: Path, data_dir: Path) -> None:
    """promtool tsdb create-blocks-from openmetrics: the file's samples become blocks of `data_dir`."""
    need_prometheus()
    data_dir.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([PROMTOOL, "tsdb", "create-blocks-from", "openmetrics", str(openmetrics), str(data_dir)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]


def scrape_config(targets: list[str], interval_s: float = 1.0) -> str:
    if not targets:
        return "global: {}\n"
    every = f"{round(interval_s * 1000)}ms"
    return (f"global:\n  scrape_interval: {every}\n  scrape_timeout: {every}\n"
            f"scrape_configs:\n  - job_name: fleetlens\n    static_configs:\n      - targets: {targets!r}\n")


def leftovers(token: str) -> list[int]:
    """Pids of live processes whose environment carries this token."""
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get(MARKER) == token:
                found.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


class PrometheusServer:
    def __init__(self, proc: subprocess.Popen, port: int, token: str, data_dir: Path) -> None:
        self.proc, self.port, self.token, self.data_dir = proc, port, token, data_dir
        self.url = f"http://127.0.0.1:{port}"

    def query(self, promql: str) -> list[dict]:
        body = httpx.get(f"{self.url}/api/v1/query", params={"query": promql}, timeout=30).json()
        assert body["status"] == "success", body
        return body["data"]["result"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


@contextmanager
def prometheus(folder: Path, *, targets: list[str] | None = None, data_dir: Path | None = None,
               scrape_interval_s: float = 1.0, config_text: str | None = None) -> Iterator[PrometheusServer]:
    """A running Prometheus with its config and data in `folder` (or `data_dir`), stopped on the way out;
    `config_text`: a whole prometheus.yml of the test's own instead of one scraping `targets`."""
    need_prometheus()
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "prometheus.yml"
    config.write_text(config_text if config_text is not None else scrape_config(targets or [], scrape_interval_s))
    data_dir = data_dir or folder / "data"
    port, token = free_port(), uuid.uuid4().hex
    log = open(folder / "prometheus.log", "w")
    # backfilled recordings are years old: no retention may delete them
    proc = subprocess.Popen(
        [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={data_dir}",
         f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=100y",
         f"--web.console.templates={folder}", f"--web.console.libraries={folder}"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, MARKER: token}, cwd=folder,
    )
    server = PrometheusServer(proc, port, token, data_dir)
    try:
        deadline = time.monotonic() + 180  # a bound, not a goal: a busy machine starts it slowly
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"prometheus exited: {(folder / 'prometheus.log').read_text()[-2000:]}")
            try:
                if httpx.get(f"{server.url}/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"prometheus not ready: {(folder / 'prometheus.log').read_text()[-2000:]}")
            time.sleep(0.2)
        yield server
    finally:
        server.stop()
        log.close()
        assert not leftovers(token), "a Prometheus outlived its test"


@contextmanager
def recorded_prometheus(folder: Path, *recordings: str) -> Iterator[PrometheusServer]:
    """A running Prometheus over recorded series: each OpenMetrics text (ending in `# EOF`) is written to a file of
    `folder` and backfilled into `folder / "data"`, which the server then reads; stopped on the way out."""
    for k, text in enumerate(recordings):
        path = folder / f"recording-{k}.om"
        path.write_text(text)
        backfill(path, folder / "data")
    with prometheus(folder, data_dir=folder / "data") as server:
        yield server
