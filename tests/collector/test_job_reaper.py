"""The job reaper: a managed job that ends has its placement ended, whatever else fails on the way."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import select

from collector.job_reaper import ReaperHost, _Reaper
from store.db import Store
from store.models import Placement, Workflow
from store.registry import DeviceSpec, register_devices, register_host
from store.settings import Settings

NOW = 1_000_000.0


class Ended:
    """A job's process (as Popen) that has exited."""

    def __init__(self, pid: int, returncode: int) -> None:
        self.pid, self.returncode = pid, returncode

    def poll(self) -> int:
        return self.returncode


def _placed(store: Store, workflow_id: str, pid: int) -> None:
    with store.session() as s:
        register_host(s, "h1", hostname="h1", source="cpu")
        device = register_devices(s, "h1", [DeviceSpec(0, "cpu:h1:0", "cpu core 0", 1 << 30, (0,))], source="cpu")[0]
        s.add(Workflow(id=workflow_id, managed=True, command=["train"], state="running", created_at=NOW,
                       last_seen=NOW))
        s.flush()
        s.add(Placement(workflow_id=workflow_id, device_id=device, host_id="h1", pid=pid, state="active",
                        started_at=NOW))


def _placement_state(store: Store, workflow_id: str) -> str:
    with store.session() as s:
        return s.scalar(select(Placement.state).where(Placement.workflow_id == workflow_id))


def test_a_job_s_ending_is_recorded_even_when_writing_the_sdk_s_steps_first_fails(sqlite_store: Store,
                                                                                    fleet_home: Path) -> None:
    _placed(sqlite_store, "wf", 4242)

    def flush_sdk() -> None:
        raise RuntimeError("a step summary the database refuses")

    reaper = _Reaper()
    reaper.host = ReaperHost(sqlite_store, Settings(), jobs=None, gate=None, flush_sdk=flush_sdk)
    reaper.add(Ended(4242, 0), "wf")
    reaper.reap()
    reaper.reap()
    assert _placement_state(sqlite_store, "wf") == "ended"  # the device is free again
    assert reaper.children == {} and reaper.pending == []


def test_one_ending_that_cannot_be_recorded_does_not_lose_the_others(sqlite_store: Store, fleet_home: Path,
                                                                     monkeypatch) -> None:
    import collector.job_reaper as job_reaper

    _placed(sqlite_store, "wf", 4242)
    recorded = job_reaper.end_placements

    def end_placements(store, workflow_id, *args, **kwargs):
        if workflow_id == "broken":
            raise ValueError("a row the database refuses")
        return recorded(store, workflow_id, *args, **kwargs)

    monkeypatch.setattr(job_reaper, "end_placements", end_placements)
    reaper = _Reaper()
    reaper.host = ReaperHost(sqlite_store, Settings(), jobs=None, gate=None, flush_sdk=lambda: None)
    reaper.add(Ended(1111, 1), "broken")  # ended first, so recorded first
    reaper.add(Ended(4242, 0), "wf")
    reaper.reap()
    assert _placement_state(sqlite_store, "wf") == "ended"
    assert reaper.pending == []  # the broken one is said in the log, not retried forever
