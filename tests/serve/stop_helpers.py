"""Helpers for the stopping tests: start a `fleetlens` command as a script would, signal it, and wait on it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

FLEETLENS = str(Path(sys.executable).with_name("fleetlens"))
SIGNALS = (signal.SIGINT, signal.SIGTERM)
HANG_GUARD_S = 60.0  # a command that has not exited this long after the signal is reported as hanging


def clean_env(home: Path, **extra: str) -> dict[str, str]:
    """This process's environment without its FLEETLENS_ settings, with a home of the test's own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETLENS_")}
    env.update({"FLEETLENS_HOME": str(home), "FLEETLENS_SECRET": "stop-test-secret", **extra})
    return env


def start(args: list[str], env: dict[str, str], log: Path, *, sigint: str = "default") -> subprocess.Popen:
    """Start `fleetlens ARGS` in a session of its own, SIGINT at its default disposition (whatever this test
    process has), or ignored as a non-interactive shell leaves it for a background command (`sigint="ignored"`)."""
    disposition = signal.SIG_IGN if sigint == "ignored" else signal.SIG_DFL

    def child() -> None:
        signal.signal(signal.SIGINT, disposition)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    with open(log, "ab") as out:
        return subprocess.Popen([FLEETLENS, *args], env=env, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=child)


def wait_for(what: str, predicate: Callable[[], object], proc: subprocess.Popen, log: Path,
             timeout: float = 240.0, every: float = 0.25) -> object:
    """Poll `predicate` until it is true; fail at once if `proc` exits, or after `timeout` (saying what for)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = predicate()
        except AssertionError:
            raise
        except Exception:  # the store may not exist yet, or be mid-write
            value = None
        if value:
            return value
        assert proc.poll() is None, f"exited with {proc.returncode} while waiting for {what}:\n{tail(log)}"
        assert time.monotonic() < deadline, f"no {what} within {timeout:.0f} s:\n{tail(log)}"
        time.sleep(every)


def stop(proc: subprocess.Popen, sig: int, log: Path) -> tuple[int, float]:
    """Send `sig` and wait for the exit: (exit code, seconds it took, for the report)."""
    sent = time.monotonic()
    proc.send_signal(sig)
    try:
        code = proc.wait(timeout=HANG_GUARD_S)
    except subprocess.TimeoutExpired:
        name = signal.Signals(sig).name
        raise AssertionError(f"still running {HANG_GUARD_S:.0f} s after {name}:\n{tail(log)}") from None
    took = time.monotonic() - sent
    print(f"{signal.Signals(sig).name}: exit {code} after {took:.1f} s")
    return code, took


def tail(log: Path, n: int = 4000) -> str:
    try:
        return log.read_text(errors="replace")[-n:]
    except OSError:
        return "(no log)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False
