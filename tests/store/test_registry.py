"""Registration of hosts, devices and processes as agents report them, including processes that come back."""

from __future__ import annotations

from sqlalchemy import event, select

from store.models import Device, Host, Process
from store.registry import (
    DeviceSpec,
    SeenProcess,
    add_hosts,
    record_processes,
    register_devices,
    register_devices_of_hosts,
    register_host,
)
from store.workflows import upsert_workflow


def test_devices_register_once_and_refresh(any_store):
    with any_store.session() as s:
        register_host(s, "h", hostname="h", source="cpu")
        first = register_devices(s, "h", [DeviceSpec(0, "u0", "cpu 0", 1 << 30), DeviceSpec(1, "u1", "cpu 1", 1 << 30)],
                                 source="cpu")
        again = register_devices(s, "h", [DeviceSpec(0, "u0", "cpu 0", 2 << 30)], source="cpu")
        assert again[0] == first[0]
        assert s.get(Device, first[0]).memory_total == 2 << 30


def test_many_hosts_devices_register_in_a_fixed_number_of_statements_and_refresh(any_store):
    statements = []
    event.listen(any_store.engine, "before_cursor_execute", lambda *a, **k: statements.append(a[2]))
    specs = {f"h{h}": [DeviceSpec(i, f"u{h}-{i}", "A100", 80 << 30) for i in range(8)] for h in range(4)}
    with any_store.session() as s:
        add_hosts(s, list(specs), source="prometheus", labels={"imported_from": "x"}, now=5.0)
        first = register_devices_of_hosts(s, specs, source="prometheus", now=5.0)
        assert len(statements) <= 4  # hosts, read, insert (one statement each, whatever the number of devices)
        assert sorted(first) == sorted((h, i) for h in specs for i in range(8))
        assert len(set(first.values())) == 32
        assert s.get(Host, "h2").labels == {"imported_from": "x"}
        # a known device is refreshed (a new uuid after a swap, its memory), a new one added, ids kept
        again = register_devices_of_hosts(s, {"h0": [DeviceSpec(0, "swapped", "A100", 40 << 30),
                                                     DeviceSpec(8, "u0-8", "A100", 80 << 30)]},
                                          source="prometheus", now=9.0)
        assert again[("h0", 0)] == first[("h0", 0)] and ("h0", 8) in again
        d = s.get(Device, first[("h0", 0)])
        assert (d.uuid, d.memory_total, d.last_seen, d.registered_at) == ("swapped", 40 << 30, 9.0, 5.0)
        assert s.scalar(select(Device.uuid).where(Device.id == again[("h0", 8)])) == "u0-8"
        assert register_devices_of_hosts(s, {}, source="prometheus", now=9.0) == {}


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
