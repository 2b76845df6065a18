"""What the agent keeps per process (the SDK's memory figures, the context pairs, goodbyes, the attribution cache)
goes when the process ends, once its workflow's figures are in the store: kept for good, a long-lived agent's memory
grew with every short job it ever served."""

from __future__ import annotations

import time

from collector import sdk_processes
from collector.agent import Agent
from collector.agent_procs import PROC_FORGET_ROUNDS
from collector.sdk_handlers import SdkHandlers
from collector.sources.base import DeviceReading, ProcessReading
from store.db import Store
from store.device_memory import CONTEXT_LABEL
from store.models import Workflow
from store.settings import Settings
from tests.collector.agent_helpers import StubSource
from tests.collector.test_context_memory import GiB, batch


def _job(handlers: SdkHandlers, wf: str, pid: int, *, persistent: int = GiB, bye: bool = True) -> None:
    now = time.time()
    handlers.note_process_memory([(pid, 3 * GiB, now)])  # NVML's half of the context pair
    steps = batch(now, 2 * GiB)
    steps["mem_persistent"] = persistent
    reply = handlers.handle({"op": "steps", "v": 1, "workflow": wf, "pid": pid, "batches": [steps]})
    assert reply.get("ok") is not False, reply
    if bye:
        handlers.handle({"op": "bye", "v": 1, "workflow": wf, "pid": pid, "outcome": "finished"})


def _kept(handlers: SdkHandlers) -> dict[str, int]:
    context = handlers._context
    return {"memory": len(handlers._mem), "context pairs": len(context._pairs), "ended": len(handlers._processes.ended),
            "context of ended": len(context._ended)}


def test_many_short_jobs_leave_nothing_behind_and_their_figures_are_stored(sqlite_store: Store, fleet_home) -> None:
    handlers = SdkHandlers(sqlite_store, "h1", Settings(), sync_interval_s=3600)
    try:
        for j in range(300):
            _job(handlers, f"job-{j}", 10_000 + j)
        handlers.flush()  # the figures are written
        handlers.flush()  # and what was kept of the ended processes goes
        assert _kept(handlers) == {"memory": 0, "context pairs": 0, "ended": 0, "context of ended": 0}
        with sqlite_store.session() as s:
            rows = s.query(Workflow).filter(Workflow.id.like("job-%")).all()
        assert len(rows) == 300
        assert all(w.mem_persistent == GiB and w.labels[CONTEXT_LABEL] == GiB for w in rows)
    finally:
        handlers.close()


def test_a_process_that_ended_still_counts_for_its_workflow_while_another_runs(sqlite_store: Store,
                                                                              fleet_home) -> None:
    handlers = SdkHandlers(sqlite_store, "h1", Settings(), sync_interval_s=3600)
    try:
        _job(handlers, "wf", 1, persistent=4 * GiB, bye=False)  # rank 0, the larger
        _job(handlers, "wf", 2, persistent=GiB, bye=False)
        handlers.flush()
        handlers.handle({"op": "bye", "v": 1, "workflow": "wf", "pid": 1, "outcome": "finished"})
        for _ in range(3):  # the other rank reports on: its figures are written again, the ended one's with them
            _job(handlers, "wf", 2, persistent=GiB, bye=False)
            handlers.flush()
        with sqlite_store.session() as s:
            assert s.get(Workflow, "wf").mem_persistent == 4 * GiB
        assert len(handlers._mem) == 2  # the running process, and one entry for those of the workflow that ended
    finally:
        handlers.close()


def test_a_job_gone_silent_is_pruned_too(sqlite_store: Store, fleet_home, monkeypatch) -> None:
    handlers = SdkHandlers(sqlite_store, "h1", Settings(), sync_interval_s=3600)
    try:
        for j in range(50):
            _job(handlers, f"killed-{j}", 20_000 + j, bye=False)  # killed: no goodbye
        handlers.flush()
        monkeypatch.setattr(sdk_processes, "JOB_FORGET_S", -1.0)  # every job silent past the limit
        assert handlers.jobs() == []
        handlers.flush()
        assert _kept(handlers) == {"memory": 0, "context pairs": 0, "ended": 0, "context of ended": 0}
    finally:
        handlers.close()


def test_goodbyes_nobody_takes_are_not_kept_without_bound(sqlite_store: Store, fleet_home, monkeypatch) -> None:
    monkeypatch.setattr(sdk_processes, "MAX_KEPT_OUTCOMES", 10)
    handlers = SdkHandlers(sqlite_store, "h1", Settings(), sync_interval_s=3600)
    try:
        for j in range(100):
            handlers.handle({"op": "bye", "v": 1, "workflow": f"w{j}", "pid": j + 1, "outcome": "finished"})
        assert len(handlers._processes.outcomes) == 10
        assert handlers.take_outcome("w99", 100) == "finished"  # the newest are kept
    finally:
        handlers.close()


class ShortProcesses(StubSource):
    """One device whose process is a new one every round (short jobs), its workflow known to the source."""

    def __init__(self) -> None:
        super().__init__(1)
        self.next_pid = 1_000_000

    def sample(self) -> list[DeviceReading]:
        self.next_pid += 1
        return [DeviceReading(index=0, ts=time.time(), gpu_util=0.5, processes=[
            ProcessReading(pid=self.next_pid, mem_used=GiB, workflow_id=f"short-{self.next_pid}", id_source="env")])]


def test_the_agent_forgets_processes_the_devices_no_longer_list(sqlite_store: Store, fleet_home) -> None:
    agent = Agent(sqlite_store, Settings(), ShortProcesses(), host_id="h-short", serve_socket=False)
    try:
        for _ in range(10 * PROC_FORGET_ROUNDS):
            agent.sample_once()
        assert len(agent._procs.known) <= PROC_FORGET_ROUNDS
        assert agent.source.next_pid in agent._procs.known  # the process running now is still known
    finally:
        agent.stop()
