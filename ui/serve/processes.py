"""The child processes `fleetlens demo`, `serve` and `ui` start, turning SIGINT/SIGTERM into a clean stop, and
stopping every process of a home (found by its environment) within a deadline, naming any survivor."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# the terminal went away (ssh dropped, window closed): a stop as well, unless the command was started to outlive it
# (nohup, which leaves SIGHUP ignored); without a handler the command died there and left its children running
HANGUP = signal.SIGHUP
STOP_BUDGET_S = 15.0  # everything a command started is gone this long after SIGINT/SIGTERM
TERM_GRACE_S = STOP_BUDGET_S - 4.0  # between SIGTERM and SIGKILL (a job writing its checkpoint); then reaping
_GONE = (psutil.NoSuchProcess, psutil.ZombieProcess)


class Stopped(KeyboardInterrupt):
    """SIGINT, SIGTERM or SIGHUP arrived; `exit_code` is the shell's 128 + signal number (130, 143, 129)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.exit_code = 128 + signum


class Signals:
    """The stop signals received in a `stop_on_signals` block."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self.shield = False  # while stopping: a signal is noted, not raised

    def handler(self, signum: int, _frame: object) -> None:
        self.received.append(signum)
        if len(self.received) == 1 and not self.shield:
            raise Stopped(signum)

    @property
    def exit_code(self) -> int | None:
        """128 + the first signal received, or None."""
        return 128 + self.received[0] if self.received else None

    @contextmanager
    def shielded(self) -> Iterator[None]:
        """The block (a stop under way) runs to its end whatever signal comes."""
        before, self.shield = self.shield, True
        try:
            yield
        finally:
            self.shield = before

    @contextmanager
    def deferred(self) -> Iterator[None]:
        """The block (a child started and recorded, so that the stop finds it) runs to its end; a stop signal that
        came meanwhile is raised as `Stopped` after it."""
        before = len(self.received)
        with self.shielded():
            yield
        if not before and self.received:
            raise Stopped(self.received[0])


@contextmanager
def stop_on_signals() -> Iterator[Signals]:
    """In the block, the first SIGINT or SIGTERM (or SIGHUP) raises `Stopped` in the main thread; later ones (and any
    inside `Signals.shielded`) are only noted. The handlers replace an inherited SIG_IGN (a command started in the
    background by a script ignores SIGINT), but for SIGHUP (nohup ignores it on purpose), and children started in
    the block get the default disposition back at exec."""
    signals = Signals()
    previous = {sig: signal.signal(sig, signals.handler) for sig in STOP_SIGNALS}
    if signal.getsignal(HANGUP) is not signal.SIG_IGN:
        previous[HANGUP] = signal.signal(HANGUP, signals.handler)
    try:
        yield signals
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def fleetlens_command(*args: str) -> list[str]:
    """The `fleetlens` entry point of this very installation."""
    return [str(Path(sys.executable).with_name("fleetlens")), *args]


class Children:
    """Processes started in sessions of their own, logging to files, all stopped together.

    Spawn them inside `stop_on_signals`: a handled signal is reset to the default at exec, an ignored one is not."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen] = []

    def spawn(self, args: list[str], log_name: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        with open(self.log_dir / log_name, "ab") as log:
            proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, env=os.environ.copy() if env is None else env)
        self.procs.append(proc)
        return proc

    def terminate(self) -> None:
        """SIGTERM each child's whole session (the child and whatever it started in it)."""
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass

    def stop(self, grace_s: float = TERM_GRACE_S) -> list[psutil.Process]:
        """SIGTERM the children's sessions, SIGKILL what is left after `grace_s`; returns the survivors."""
        self.terminate()
        members = _living(_session_members({p.pid for p in self.procs}) | {p.pid for p in self.procs})
        _, alive = psutil.wait_procs(members, timeout=grace_s)
        for proc in alive:
            _kill(proc)
        _, alive = psutil.wait_procs(alive, timeout=2)
        for proc in self.procs:
            try:
                proc.wait(timeout=1)
            except subprocess.TimeoutExpired:
                pass
        return alive


def _session_members(sids: set[int]) -> set[int]:
    members = set()
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getsid(proc.pid) in sids:
                members.add(proc.pid)
        except OSError:
            continue
    return members


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
    except _GONE:
        pass


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except _GONE:
        return False


def processes_with_env(name: str, value: str) -> list[psutil.Process]:
    """Every live process (this one excepted) whose environment sets `name` to `value`."""
    me = os.getpid()
    found = []
    for proc in psutil.process_iter(["pid"]):
        if proc.pid == me:
            continue
        try:
            if proc.environ().get(name) == value and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def processes_of(home: Path) -> list[psutil.Process]:
    """Every process started with FLEETLENS_HOME=home (an agent, the jobs it launched, a dashboard)."""
    return processes_with_env("FLEETLENS_HOME", str(home))


def describe(proc: psutil.Process) -> str:
    try:
        return f"pid {proc.pid} ({' '.join(proc.cmdline())[:160]})"
    except psutil.Error:
        return f"pid {proc.pid}"


def stop_processes_of(home: Path, grace_s: float = TERM_GRACE_S, settle_s: float = 2.0) -> list[psutil.Process]:
    """SIGTERM every process of `home` (jobs the agent owned included), SIGKILL what is left after `grace_s`, and
    return the survivors. Processes of `home` that appear while waiting (an agent relaunching a job as it is
    told to stop) are looked for again until the deadline and stopped too."""
    deadline = time.monotonic() + grace_s
    seen: dict[int, psutil.Process] = {}
    while True:
        fresh = [p for p in processes_of(home) if p.pid not in seen]
        for proc in fresh:
            seen[proc.pid] = proc
            try:
                proc.terminate()
            except _GONE:
                pass
        if not any(_alive(p) for p in seen.values()) and not fresh:
            break
        if time.monotonic() >= deadline:
            break
        wait = max(0.0, min(0.5, deadline - time.monotonic()))
        psutil.wait_procs([p for p in seen.values() if _alive(p)], timeout=wait)
    left = [p for p in seen.values() if _alive(p)] + [p for p in processes_of(home) if p.pid not in seen]
    for proc in left:
        _kill(proc)
    psutil.wait_procs(left, timeout=settle_s)
    return [p for p in processes_of(home)]


def run_foreground(args: list[str], env: dict[str, str], grace_s: float = TERM_GRACE_S) -> int:
    """Run `args` in this process group (a terminal's Ctrl-C and a group kill reach it too) and return its exit
    code. Call it inside `stop_on_signals`: on `Stopped` the child gets SIGTERM (SIGKILL after `grace_s`) and is
    waited for before `Stopped` goes on up."""
    proc = subprocess.Popen(args, env=env)
    try:
        return proc.wait()
    except Stopped:
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise
