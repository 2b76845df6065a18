"""Which workflow each process the agent's devices list belongs to (collector.attribution), cached per pid, re-checked
for pid reuse, and pruned to the processes the devices still list."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import psutil

from collector import attribution
from collector.agent_batch import KnownProcess

# the processes cached for attribution are pruned to those the devices listed in the last this many rounds: a process
# that ended leaves (one that comes back is looked up again); kept for good, the cache grew with every pid ever seen
PROC_FORGET_ROUNDS = 60

Attribute = Callable[[int], tuple[str, str] | None]  # pid -> (workflow id, how it was found), or None


def default_attribute(pid: int) -> tuple[str, str] | None:
    """(workflow id, how it was found) for `pid`, from collector.attribution."""
    result = attribution.attribute(pid)
    if result is None:
        return None
    if isinstance(result, tuple):
        return str(result[0]), str(result[1])
    return str(result.workflow_id), str(getattr(result, "id_source", "cmdline"))


class ProcessCache:
    """The sampler's processes by pid. `known` is replaced, never changed in place, when pruned: /metrics reads it
    from another thread."""

    def __init__(self, host_id: str, attribute: Attribute | None = None) -> None:
        self.host_id = host_id
        self.attribute = attribute or default_attribute
        self.known: dict[int, KnownProcess] = {}
        self.listed: set[int] = set()  # the pids the devices listed since the cache was last pruned

    def note_listed(self, pids: Iterable[int], round_: int) -> None:
        """The pids the devices listed in sampling round `round_`; every PROC_FORGET_ROUNDS rounds the cache keeps
        only those listed since the last time."""
        self.listed.update(pids)
        if round_ % PROC_FORGET_ROUNDS == PROC_FORGET_ROUNDS - 1:
            # a new dict in place of the old: /metrics reads the cache from another thread
            self.known = {pid: proc for pid, proc in self.known.items() if pid in self.listed}
            self.listed = set()

    def lookup(self, p: Any, now: float) -> KnownProcess | None:
        """The workflow of the process on a device; cached per pid and re-checked for pid reuse now and then (at once
        when the source gives the process's start time and it is not the cached one's)."""
        cached = self.known.get(p.pid)
        if cached is not None and p.workflow_id is None and p.start_time and cached.start_time != p.start_time:
            cached = None  # another process under the same pid
        if cached is not None and (now - cached.checked_at < 30.0 or p.workflow_id is not None):
            return cached
        if p.workflow_id is not None:  # the source knows (replay): no /proc to read
            proc = KnownProcess(p.pid, p.start_time or 0.0, p.workflow_id, p.id_source or "env", checked_at=now)
            self.known[p.pid] = proc
            return proc
        try:
            ps = psutil.Process(p.pid)
            with ps.oneshot():
                start_time = ps.create_time()
                if cached is not None and cached.start_time == start_time:
                    cached.checked_at = now
                    return cached
                cmdline = " ".join(ps.cmdline()) or ps.name()
                username = ps.username()
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            self.known.pop(p.pid, None)
            return None  # gone between the device listing it and us reading it
        except psutil.AccessDenied:
            start_time, cmdline, username = p.start_time or 0.0, None, None
        try:
            attributed = self.attribute(p.pid)
        except (ProcessLookupError, PermissionError, FileNotFoundError):
            attributed = None
        if attributed is None:
            attributed = (f"pid:{p.pid}@{self.host_id}", "cmdline")
        proc = KnownProcess(p.pid, start_time, attributed[0], attributed[1], cmdline, username, checked_at=now)
        self.known[p.pid] = proc
        return proc
