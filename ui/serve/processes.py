"""The child processes `fleetlens demo` and `fleetlens serve` start (agent, dashboard), and stopping them all."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil


def fleetlens_command(*args: str) -> list[str]:
    """The `fleetlens` entry point of this very installation."""
    return [str(Path(sys.executable).with_name("fleetlens")), *args]


class Children:
    """Processes started in sessions of their own, logging to files, all stopped together."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen] = []

    def spawn(self, args: list[str], log_name: str) -> subprocess.Popen:
        with open(self.log_dir / log_name, "ab") as log:
            proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, env=os.environ.copy())
        self.procs.append(proc)
        return proc

    def stop(self, grace_s: float = 15.0) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)  # the child and whatever it started in its session
                except ProcessLookupError:
                    pass
        _, alive = psutil.wait_procs(_living(p.pid for p in self.procs), timeout=grace_s)
        for proc in alive:
            _kill(proc)
        for proc in self.procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass


def _living(pids: Iterable[int]) -> list[psutil.Process]:
    """The processes of `pids` still there (one may exit between our looking and our asking)."""
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    return procs


def _kill(proc: psutil.Process) -> None:
    try:
        proc.kill()
    except psutil.NoSuchProcess:
        pass


def processes_of(home: Path) -> Iterator[psutil.Process]:
    """Every process started with FLEETLENS_HOME=home (an agent, the jobs it launched, a dashboard)."""
    me = os.getpid()
    for proc in psutil.process_iter(["pid"]):
        if proc.pid == me:
            continue
        try:
            if proc.environ().get("FLEETLENS_HOME") == str(home):
                yield proc
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue


def stop_processes_of(home: Path, grace_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after `grace_s`, to every process of `home` (jobs the agent owned included)."""
    procs = list(processes_of(home))
    for proc in procs:
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive:
        _kill(proc)
    psutil.wait_procs(alive, timeout=5)


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM behaves like Ctrl-C, so `kill` also stops every process started in the block."""

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
