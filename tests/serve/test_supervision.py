"""`fleetlens serve` keeps its children running (ui.serve.supervision): a child that exits is said, with its code and
log, and started again after a back-off that doubles while it keeps failing and starts over once it ran steadily."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from ui.serve.processes import Children
from ui.serve.supervision import Supervisor

FAIL = [sys.executable, "-c", "import sys; sys.exit(3)"]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _exited(sup: Supervisor, name: str) -> None:
    """Wait until the child's process has really ended (the clock is the test's; the process is real)."""
    proc = sup._kids[name].proc
    proc.wait(timeout=30)


def test_a_failing_child_is_started_again_after_a_doubling_back_off(tmp_path: Path):
    said: list[str] = []
    clock = Clock()
    children = Children(tmp_path)
    sup = Supervisor(children, said.append, clock=clock, first_backoff_s=1, max_backoff_s=4, steady_s=60)
    sup.start("worker", FAIL, "worker.log")
    try:
        waits = []
        for _ in range(4):
            _exited(sup, "worker")
            sup.check()  # seen to exit: the back-off starts
            assert "worker exited with code 3" in said[-1] and str(tmp_path / "worker.log") in said[-1]
            waits.append(sup._kids["worker"].restart_at - clock.now)
            clock.now += waits[-1] - 0.01
            sup.check()  # not yet
            assert sup.restarts("worker") == len(waits) - 1
            clock.now += 0.01
            sup.check()  # now
            assert sup.restarts("worker") == len(waits) and "started again" in said[-1]
        assert waits == [1, 2, 4, 4]  # doubling, capped
        _exited(sup, "worker")
        clock.now += 61  # it ran a minute before it exited: the back-off starts over
        sup.check()
        assert sup._kids["worker"].restart_at - clock.now == 1
    finally:
        assert children.stop(grace_s=5) == []


def test_a_running_child_is_left_alone(tmp_path: Path):
    said: list[str] = []
    children = Children(tmp_path)
    sup = Supervisor(children, said.append)
    sup.start("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"], "sleeper.log")
    try:
        for _ in range(3):
            sup.check()
            time.sleep(0.05)
        assert said == [] and sup.restarts("sleeper") == 0
    finally:
        assert children.stop(grace_s=5) == []
