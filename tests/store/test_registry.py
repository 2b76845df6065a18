"""Registration of hosts, devices and processes as agents report them, including processes that come back."""

from __future__ import annotations

from sqlalchemy import select

from store.models import Device, Process
from store.registry import DeviceSpec, SeenProcess, record_processes, register_devices, register_host
from store.workflows import upsert_workflow


def test_devices_register_once_and_refresh(any_store):
    with any_store.session() as s:
        register_host(s, "h", hostname="h", source="cpu")
        first = register_devices(s, "h", [DeviceSpec(0, "u0", "cpu 0", 1 << 30), DeviceSpec(1, "u1", "cpu 1", 1 << 30)],
                                 source="cpu")
        again = register_devices(s, "h", [DeviceSpec(0, "u0", "cpu 0", 2 << 30)], source="cpu")
        assert again[0] == first[0]
        assert s.get(Device, first[0]).memory_total == 2 << 30


def test_processes_end_and_come_back_without_duplicates(any_store):
    with any_store.session() as s:
        register_host(s, "h", hostname="h", source="cpu")
        upsert_workflow(s, "wf")
        p = SeenProcess(pid=10, start_time=123.25, workflow_id="wf")
        record_processes(s, "h", [p], now=1.0)
        record_processes(s, "h", [], now=2.0)  # missed one round: marked ended
        assert s.scalar(select(Process.ended_at)) == 2.0
        record_processes(s, "h", [p], now=3.0)  # seen again: reopened, not inserted twice
        rows = s.scalars(select(Process)).all()
        assert len(rows) == 1 and rows[0].ended_at is None and rows[0].last_seen == 3.0
        record_processes(s, "h", [SeenProcess(pid=10, start_time=999.0, workflow_id="wf")], now=4.0)  # pid reused
        assert len(s.scalars(select(Process)).all()) == 2
