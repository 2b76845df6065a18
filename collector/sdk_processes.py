"""The job processes an agent's SDK handlers serve (collector.sdk_handlers): who was heard from lately, the last step
taken from each (a summary a job sends again is taken once), how each said it ended (its goodbye), and which ended or
went silent, so that what is kept of them goes once their workflow's figures are written.

Not thread-safe: the handlers call every method under their lock.
"""

from __future__ import annotations

import time
from typing import Any

from collector.sdk_context import ContextMeter
from collector.sdk_memory import ProcessMemory, fold_ended, forget_workflow

JOB_FORGET_S = 600.0  # a job silent this long is dropped from `jobs()` and no longer polled for in the store
# goodbyes kept for take_outcome: the reaper takes those of the jobs it started at once; nobody asks for the others
MAX_KEPT_OUTCOMES = 4096

Key = tuple[str, int]  # (workflow, pid)


class ProcessBook:
    """What the handlers know of each job process, beside its memory figures (`mem`, `context`: shared with the
    handlers, which fill them; what is kept there of a process that ended goes in `prune_ended`)."""

    def __init__(self, mem: ProcessMemory, context: ContextMeter) -> None:
        self.mem, self.context = mem, context
        self.jobs: dict[Key, dict[str, Any]] = {}
        self.outcomes: dict[Key, str] = {}  # (wf, pid) -> what the job said in its goodbye
        # (wf, pid) of the goodbyes heard, the newest MAX_KEPT_OUTCOMES: the reaper takes an outcome away, but a
        # launch still waiting to see the job start must learn that it said goodbye (it ran, then ended)
        self.byes: dict[Key, None] = {}
        # processes that said goodbye or went silent: what is kept of them goes once their workflow's figures are
        # written (prune_ended); kept for good, a long-lived agent's memory grew with every job it ever served
        self.ended: set[Key] = set()
        # (wf, pid) -> the last step of the step summaries taken from that process: a summary the job sends again
        # (our reply came after its timeout, so it kept the summary) is taken once
        self.taken_steps: dict[Key, int] = {}

    def seen(self, msg: dict[str, Any], step: int | None = None) -> None:
        key = (msg["workflow"], int(msg["pid"]))
        job = self.jobs.setdefault(key, {"workflow": key[0], "pid": key[1], "rank": int(msg.get("rank") or 0)})
        job["last_seen"] = time.time()
        for name in ("lane", "total_steps", "name"):
            if msg.get(name) is not None:
                job[name] = msg[name]
        if step is not None:
            job["step"] = int(step)

    def hello(self, key: Key, start: int | None) -> None:
        """A process says hello from step `start`."""
        if start is not None and start <= self.taken_steps.get(key, -1):
            del self.taken_steps[key]  # a new process under an old one's pid, from an earlier step

    def fresh(self, key: Key, batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The step summaries of `batches` not taken from the process before, now taken."""
        taken = self.taken_steps.get(key, -1)
        fresh = [b for b in batches if int(b["last_step"]) > taken]
        if fresh:
            self.taken_steps[key] = int(fresh[-1]["last_step"])
        return fresh

    def bye(self, key: Key, outcome: str) -> None:
        """The process said how it ended."""
        self.jobs.pop(key, None)
        self.taken_steps.pop(key, None)
        self.outcomes[key] = outcome
        while len(self.outcomes) > MAX_KEPT_OUTCOMES:  # the oldest, which nobody took
            del self.outcomes[next(iter(self.outcomes))]
        self.byes[key] = None
        while len(self.byes) > MAX_KEPT_OUTCOMES:
            del self.byes[next(iter(self.byes))]
        self.context.forget(key[1])
        self.ended.add(key)

    def forget_silent(self, now: float) -> None:
        for key in [k for k, job in self.jobs.items() if now - job["last_seen"] > JOB_FORGET_S]:
            del self.jobs[key]
            self.taken_steps.pop(key, None)
            self.context.forget(key[1])
            self.ended.add(key)

    def prune_ended(self, dirty: set[str]) -> None:
        """What is kept of processes that ended, once their workflow's figures are written (it is not in `dirty`):
        folded into the workflow's figures while another of its processes runs here, else dropped with the workflow's
        (the store holds them; a process of it that starts here later begins afresh, as after an agent restart)."""
        for key in [k for k in self.ended if k[0] not in dirty]:
            self.ended.discard(key)
            if key in self.jobs:  # silent a while, then heard from again: it runs
                continue
            wf = key[0]
            fold_ended(self.mem, key)
            if not any(k[0] == wf for k in self.jobs):
                forget_workflow(self.mem, wf)
                self.context.forget_workflow(wf)
