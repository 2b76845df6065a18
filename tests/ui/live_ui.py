"""A real `fleetlens ui` for the browser tests: started on a free port, answered its health check, and stopped (its
own process group, nothing else) however the test ends."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_ui(log: IO[str] | None = None) -> Iterator[str]:
    """The dashboard's URL while `fleetlens ui` runs on the store the environment names; its output goes to `log`."""
    port = free_port()
    fleetlens = Path(sys.executable).with_name("fleetlens")
    proc = subprocess.Popen([str(fleetlens), "ui", "--port", str(port), "--address", "127.0.0.1"],
                            env=dict(os.environ), stdout=log or subprocess.DEVNULL, stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None, f"`fleetlens ui` exited with {proc.returncode}"
            assert time.time() < deadline, "the dashboard did not answer its health check within 60 s"
            time.sleep(0.5)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the process group started here, nothing else
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
