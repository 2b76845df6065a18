"""Registration of hosts, devices and processes as agents report them, including processes that come back."""

from __future__ import annotations

import threading

import pytest
from sqlalchemy import event, select
from sqlalchemy.exc import IntegrityError

from store.db import Store
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


def test_a_gpu_keeps_its_row_by_uuid_when_the_host_numbers_its_gpus_otherwise(any_store):
    """After a reboot NVML may list the same GPUs in another order: each keeps its row (its lanes, its history),
    where the unique UUID made the registration fail and the agent never start."""
    specs = [DeviceSpec(0, "GPU-a", "A100", 80 << 30), DeviceSpec(1, "GPU-b", "A100", 80 << 30),
             DeviceSpec(2, "GPU-c", "A100", 80 << 30)]
    with any_store.session() as s:
        register_host(s, "h", hostname="h", source="nvml")
        first = register_devices(s, "h", specs, source="nvml", now=1.0)
    by_uuid = {spec.uuid: first[spec.index] for spec in specs}
    with any_store.session() as s:  # rebooted: b and a swapped places, c is gone, d is new where c was
        again = register_devices(s, "h", [DeviceSpec(0, "GPU-b", "A100", 80 << 30),
                                          DeviceSpec(1, "GPU-a", "A100", 80 << 30),
                                          DeviceSpec(2, "GPU-d", "A100", 80 << 30)], source="nvml", now=2.0)
    assert again == {0: by_uuid["GPU-b"], 1: by_uuid["GPU-a"], 2: by_uuid["GPU-c"]}  # d took the free place
    with any_store.session() as s:
        rows = {d.uuid: (d.id, d.index, d.state) for d in s.scalars(select(Device))}
    assert rows == {"GPU-b": (by_uuid["GPU-b"], 0, "ok"), "GPU-a": (by_uuid["GPU-a"], 1, "ok"),
                    "GPU-d": (by_uuid["GPU-c"], 2, "ok")}
    with any_store.session() as s:  # a removed GPU whose index a renumbered one takes: lost, out of the way
        third = register_devices(s, "h", [DeviceSpec(0, "GPU-d", "A100", 80 << 30),
                                          DeviceSpec(1, "GPU-a", "A100", 80 << 30)], source="nvml", now=3.0)
        b = s.get(Device, by_uuid["GPU-b"])
        assert third == {0: by_uuid["GPU-c"], 1: by_uuid["GPU-a"]}
        assert (b.index, b.state) == (-b.id, "lost")


def test_a_gpu_moved_to_another_host_registers_there_and_leaves_the_old_row_lost(any_store):
    """The agent of the host a GPU was moved to registers it, where the unique UUID made it fail to start."""
    with any_store.session() as s:
        for h in ("old", "new"):
            register_host(s, h, hostname=h, source="nvml")
        old = register_devices(s, "old", [DeviceSpec(0, "GPU-x", "A100", 80 << 30)], source="nvml")[0]
    with pytest.raises(IntegrityError), any_store.session() as s:  # not the agent of the host it is on now
        register_devices(s, "new", [DeviceSpec(3, "GPU-x", "A100", 80 << 30)], source="replay")
    with any_store.session() as s:
        new = register_devices(s, "new", [DeviceSpec(3, "GPU-x", "A100", 80 << 30)], source="nvml", moved_here=True)[3]
    with any_store.session() as s:
        moved, here = s.get(Device, old), s.get(Device, new)
        assert new != old and (here.host_id, here.index, here.uuid, here.state) == ("new", 3, "GPU-x", "ok")
        assert (moved.host_id, moved.uuid, moved.state) == ("old", f"GPU-x@moved:{old}", "lost")


def test_two_agents_registering_one_new_host_at_once_both_succeed(any_store):
    """The second agent found no host, then inserted it after the first had: its start failed on the key."""
    second_store = Store(any_store.url)
    inserting = threading.Event()

    def note_insert(_conn, _cursor, statement, *_args) -> None:
        if statement.lstrip().upper().startswith("INSERT INTO HOSTS"):
            inserting.set()  # the second agent's insert goes now, while the first agent's is not committed

    event.listen(second_store.engine, "before_cursor_execute", note_insert)
    failed: list[BaseException] = []

    def second() -> None:
        try:
            with second_store.session() as s:
                register_host(s, "h", hostname="h", source="nvml", agent_pid=2)
        except BaseException as exc:
            failed.append(exc)
            inserting.set()

    try:
        with any_store.session() as s:
            register_host(s, "h", hostname="h", source="nvml", agent_pid=1)
            thread = threading.Thread(target=second)
            thread.start()
            assert inserting.wait(30)
        thread.join(60)
    finally:
        second_store.dispose()
    assert failed == []
    with any_store.session() as s:
        assert s.get(Host, "h").agent_pid == 2


def test_an_import_after_a_reboot_that_renumbered_the_gpus_refreshes_them_in_place(any_store):
    """An importer's device is its place on its host: after a renumbering each place takes its new GPU's UUID, where
    the unique UUID failed every later import of the host."""
    with any_store.session() as s:
        add_hosts(s, ["h"], source="prometheus", labels={}, now=1.0)
        first = register_devices_of_hosts(s, {"h": [DeviceSpec(i, f"GPU-{i}", "A100", 80 << 30) for i in range(3)]},
                                          source="prometheus", now=1.0)
    with any_store.session() as s:  # GPU-0 and GPU-1 swapped places; GPU-2 now at index 3, index 2 not seen
        again = register_devices_of_hosts(s, {"h": [DeviceSpec(0, "GPU-1", "A100", 80 << 30),
                                                    DeviceSpec(1, "GPU-0", "A100", 80 << 30),
                                                    DeviceSpec(3, "GPU-2", "A100", 80 << 30)]},
                                          source="prometheus", now=2.0)
    assert again[("h", 0)] == first[("h", 0)] and again[("h", 1)] == first[("h", 1)]
    with any_store.session() as s:
        rows = {d.id: (d.index, d.uuid, d.state) for d in s.scalars(select(Device))}
    left = first[("h", 2)]
    assert rows == {first[("h", 0)]: (0, "GPU-1", "ok"), first[("h", 1)]: (1, "GPU-0", "ok"),
                    left: (2, f"GPU-2@moved:{left}", "lost"), again[("h", 3)]: (3, "GPU-2", "ok")}
