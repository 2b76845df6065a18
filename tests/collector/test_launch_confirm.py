"""A launch is confirmed by the job's hello on the SDK socket. A job that exits before it ever spoke is a launch
that failed; one that said hello and ended at once (its goodbye heard before the agent looked again) has started,
and how it ended is the reaper's to record."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from collector import protocol
from collector.command_runner import CommandContext
from collector.job_start import _confirm
from collector.sdk_handlers import SdkHandlers
from store.settings import Settings


@pytest.fixture
def handlers(sqlite_store, fleet_home: Path) -> Iterator[SdkHandlers]:
    h = SdkHandlers(sqlite_store, "h1", Settings())
    yield h
    h.close()


def _ended() -> subprocess.Popen:
    """A real process that has already exited, with code 1."""
    popen = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    popen.wait()
    return popen


def _context(store, handlers: SdkHandlers) -> CommandContext:
    return CommandContext(command_id=1, kind="launch", host_id="h1", action_id=None, store=store,
                          settings=handlers.settings, sdk=handlers)


def test_a_job_that_said_goodbye_before_the_agent_looked_has_started(sqlite_store, handlers, tmp_path):
    popen = _ended()
    reply = handlers.handle({"op": protocol.BYE, "v": protocol.VERSION, "workflow": "wf", "pid": popen.pid,
                             "rank": 0, "outcome": "failed", "last_step": 3})
    assert reply == {"ok": True}
    result = _confirm(_context(sqlite_store, handlers), popen, "wf", tmp_path / "wf.log", timeout_s=5)
    assert result["connected"] is True and result["pid"] == popen.pid
    assert handlers.take_outcome("wf", popen.pid) == "failed"  # left for the reaper


def test_a_job_whose_goodbye_the_reaper_took_first_has_started(sqlite_store, handlers, tmp_path):
    """The reaper polls the same process: when it reaped the job and took its outcome before the launch looked, the
    launch took the job for one that never started ("exited at once"), though it had trained and said goodbye."""
    popen = _ended()
    assert handlers.handle({"op": protocol.BYE, "v": protocol.VERSION, "workflow": "wf", "pid": popen.pid,
                            "rank": 0, "outcome": "failed", "last_step": 3}) == {"ok": True}
    assert handlers.take_outcome("wf", popen.pid) == "failed"  # the reaper, first
    result = _confirm(_context(sqlite_store, handlers), popen, "wf", tmp_path / "wf.log", timeout_s=5)
    assert result["connected"] is True and result["pid"] == popen.pid
    assert handlers.take_outcome("wf", popen.pid) is None  # taken once


def test_a_job_that_exits_without_a_word_failed_to_start(sqlite_store, handlers, tmp_path):
    popen = _ended()
    (tmp_path / "wf.log").write_text("ImportError: no module named train\n")
    with pytest.raises(RuntimeError, match="wf exited at once with code 1: ImportError: no module named train"):
        _confirm(_context(sqlite_store, handlers), popen, "wf", tmp_path / "wf.log", timeout_s=5)
