"""`fleetlens demo` whose dashboard port another process holds: it says so and stops before it starts anything, since
the check that its dashboard is up would otherwise find the other process answering there and send the user to it."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import pytest

from tests.procs import processes_under
from tests.serve.stop_helpers import FLEETLENS, clean_env
from ui.serve.demo import DemoError, check_port_free


def test_a_demo_whose_dashboard_port_is_taken_stops_before_it_starts_anything(tmp_path: Path):
    home = tmp_path / "home"
    with socket.socket() as holder:  # another dashboard, on the loopback only: the demo's would bind every interface
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        out = subprocess.run([FLEETLENS, "demo", "--port", str(port)], env=clean_env(home), capture_output=True,
                             text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"port {port} is in use" in out.stderr and "--port N" in out.stderr
    assert not (home / "demo").exists() and processes_under(home / "demo") == []  # nothing prepared, nothing started


def test_the_port_check_tells_a_held_port_from_a_freed_one():
    with socket.socket() as holder:
        holder.bind(("", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(DemoError, match=f"port {port} is in use"):
            check_port_free(port)
    check_port_free(port)  # closed: free again (a closed listener leaves no TIME_WAIT holder)
    with pytest.raises(DemoError, match="not a TCP port"):
        check_port_free(70000)
