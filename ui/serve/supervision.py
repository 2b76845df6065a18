"""`fleetlens serve` keeps its children running: one that exits (an agent that crashed, a dashboard whose port was
taken) is said on the console and started again after a back-off that doubles while it keeps failing, from 1 s up
to a minute, and starts over once it has run a minute. Nothing is restarted while the command stops."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

from ui.serve.processes import Children

FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 60.0
STEADY_S = 60.0  # a child that ran this long before it exited is restarted after the first back-off again


@dataclass
class _Child:
    name: str
    args: list[str]
    log_name: str
    proc: subprocess.Popen
    started: float
    backoff_s: float = FIRST_BACKOFF_S
    restart_at: float | None = None
    restarts: int = 0


class Supervisor:
    """Named children of one Children set, started again when they exit (`check`, from the command's loop)."""

    def __init__(self, children: Children, say: Callable[[str], None], *, clock: Callable[[], float] = time.monotonic,
                 first_backoff_s: float = FIRST_BACKOFF_S, max_backoff_s: float = MAX_BACKOFF_S,
                 steady_s: float = STEADY_S) -> None:
        self.children = children
        self.say = say
        self.clock = clock
        self.first_backoff_s, self.max_backoff_s, self.steady_s = first_backoff_s, max_backoff_s, steady_s
        self._kids: dict[str, _Child] = {}

    def start(self, name: str, args: list[str], log_name: str) -> None:
        proc = self.children.spawn(args, log_name)
        self._kids[name] = _Child(name, args, log_name, proc, self.clock(), self.first_backoff_s)

    def restarts(self, name: str) -> int:
        return self._kids[name].restarts

    def check(self) -> None:
        """Note the children that exited and start the ones whose back-off is over."""
        now = self.clock()
        for kid in self._kids.values():
            code = kid.proc.poll()
            if code is not None and kid.restart_at is None:
                ran = now - kid.started
                if ran >= self.steady_s:
                    kid.backoff_s = self.first_backoff_s
                kid.restart_at = now + kid.backoff_s
                log = self.children.log_dir / kid.log_name
                self.say(f"{kid.name} exited with code {code} after {ran:.0f} s; starting it again in "
                         f"{kid.backoff_s:.0f} s (its log: {log})")
                kid.backoff_s = min(self.max_backoff_s, kid.backoff_s * 2)
            elif kid.restart_at is not None and now >= kid.restart_at:
                kid.proc = self.children.spawn(kid.args, kid.log_name)
                kid.started, kid.restart_at = now, None
                kid.restarts += 1
                self.say(f"{kid.name} started again (restart {kid.restarts}, pid {kid.proc.pid})")
