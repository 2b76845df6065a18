"""Stopping a home's processes by their environment, and SIGINT/SIGTERM turned into a stop with 130/143."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest

from tests.procs import processes_under
from ui.serve.processes import processes_of, stop_processes_of

# ignores SIGTERM: only SIGKILL ends it
STUBBORN = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); "
            "time.sleep(300)")
# on SIGTERM starts another process of the same home, then exits: an agent relaunching a job as it is stopped
RELAUNCHER = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    def relaunch(*_):
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
        time.sleep(0.3)
        os._exit(0)
    signal.signal(signal.SIGTERM, relaunch)
    print('up', flush=True)
    time.sleep(300)
""")


def _start(code: str, home) -> subprocess.Popen:
    env = {**os.environ, "FLEETLENS_HOME": str(home)}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    assert proc.stdout.readline().strip() == "up"
    return proc


def test_every_process_of_the_home_is_stopped_even_one_started_while_stopping(tmp_path):
    home = tmp_path / "home"
    stubborn, relauncher = _start(STUBBORN, home), _start(RELAUNCHER, home)
    other = _start(STUBBORN, tmp_path / "elsewhere")  # another home's process is none of our business
    try:
        assert {p.pid for p in processes_of(home)} == {stubborn.pid, relauncher.pid}
        survivors = stop_processes_of(home, grace_s=2.0)
        assert survivors == []
        assert processes_under(home) == []  # the relaunched one too, found by the environment it inherited
        for proc in (stubborn, relauncher):  # reaped by the stop already (so no exit code is left to read here)
            proc.wait(timeout=5)
            assert not psutil.pid_exists(proc.pid) or psutil.Process(proc.pid).status() == psutil.STATUS_ZOMBIE
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()


def _run(code: str, *, sigint_ignored: bool) -> subprocess.CompletedProcess:
    def child() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN if sigint_ignored else signal.SIG_DFL)

    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=60, preexec_fn=child, env={**os.environ, "PYTHONPATH": os.getcwd()})


def test_stop_on_signals_stops_on_sigint_even_when_it_came_in_ignored_and_shields_the_stop():
    result = _run("""
        import os, signal, time
        from ui.serve.processes import Stopped, stop_on_signals
        with stop_on_signals() as signals:
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(5)
                print("not stopped")
            except Stopped as stop:
                with signals.shielded():
                    os.kill(os.getpid(), signal.SIGTERM)  # a second signal while stopping: noted, not raised
                    time.sleep(0.2)
                    print("stopped", stop.exit_code, "then", signals.received)
        print("exit", signals.exit_code)
    """, sigint_ignored=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["stopped 130 then [2, 15]",
                                             "exit 130"]


def test_a_deferred_block_runs_to_its_end_and_the_stop_comes_after_it():
    result = _run("""
        import os, signal, time
        from ui.serve.processes import Stopped, stop_on_signals
        with stop_on_signals() as signals:
            try:
                with signals.deferred():  # a child started and recorded: never cut in between
                    os.kill(os.getpid(), signal.SIGTERM)
                    time.sleep(0.2)
                    print("block ran to its end")
                print("not stopped")
            except Stopped as stop:
                print("stopped after it", stop.exit_code)
            with signals.deferred():  # a stop already under way: nothing more is raised
                print("quiet")
        print("exit", signals.exit_code)
    """, sigint_ignored=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:4] == ["block ran to its end", "stopped after it 143", "quiet", "exit 143"]


def test_sigterm_gives_143():
    result = _run("""
        import os, signal, time
        from ui.serve.processes import Stopped, stop_on_signals
        with stop_on_signals():
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
            except Stopped as stop:
                print(stop.exit_code, stop)
    """, sigint_ignored=False)
    assert result.stdout.strip() == "143 SIGTERM", result.stderr


def test_leftovers_are_found_by_environment_not_command_line(tmp_path):
    home = tmp_path / "home"
    proc = _start(STUBBORN, home)
    try:
        # the command line says nothing of the home; the environment does
        assert str(home) not in " ".join(psutil.Process(proc.pid).cmdline())
        assert [p.pid for p in processes_under(tmp_path)] == [proc.pid]
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("nohup", [False, True])
def test_a_hangup_stops_like_sigterm_unless_the_command_was_started_under_nohup(nohup: bool):
    code = textwrap.dedent("""
        import os, signal, time
        from ui.serve.processes import Stopped, stop_on_signals
        with stop_on_signals():
            try:
                os.kill(os.getpid(), signal.SIGHUP)  # the terminal went away
                time.sleep(0.5)
                print("still running")
            except Stopped as stop:
                print(stop.exit_code, stop)
    """)
    disposition = signal.SIG_IGN if nohup else signal.SIG_DFL
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            preexec_fn=lambda: signal.signal(signal.SIGHUP, disposition),
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ("still running" if nohup else "129 SIGHUP")
