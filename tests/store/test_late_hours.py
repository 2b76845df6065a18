"""Sample writes mark the closed hours they reach, and the rollup clears a mark only if no write came since it read
it (store.late_hours), on SQLite and PostgreSQL."""

from __future__ import annotations

import time

import pyarrow as pa

from store import late_hours
from store.ingest import write_sample_batches, write_samples
from store.registry import DeviceSpec, register_devices, register_host

HOUR = 3600.0


def _device(store) -> int:
    with store.session() as s:
        register_host(s, "h1", hostname="h1", source="cpu")
        return register_devices(s, "h1", [DeviceSpec(0, "cpu-h1-0", "cpu 0", 8 << 30)], source="cpu")[0]


def _rows(dev: int, times: list[float]) -> tuple[list[dict], list[dict]]:
    return ([{"device_id": dev, "ts": t, "gpu_util": 0.5} for t in times],
            [{"device_id": dev, "workflow_id": "wf", "host_id": "h1", "pid": 1, "ts": t} for t in times])


def test_a_write_marks_the_closed_hours_it_reaches_and_not_the_open_one(any_store):
    dev = _device(any_store)
    hour = late_hours.closed_before()  # the first hour a write does not mark: the open one (or the next, near its end)
    assert time.time() < hour + HOUR
    write_samples(any_store, *_rows(dev, [hour + 1]))  # on time: no mark
    assert late_hours.marks(any_store, hour + HOUR) == {}
    write_samples(any_store, [], _rows(dev, [hour - 5 * HOUR + 10])[1])  # a process sample, five hours late
    write_samples(any_store, _rows(dev, [hour - 1, hour - 2, hour + 1])[0], [])
    assert late_hours.marks(any_store, hour + HOUR) == {hour - 5 * HOUR: 1, hour - HOUR: 1}
    write_samples(any_store, *_rows(dev, [hour - 30]))
    assert late_hours.marks(any_store, hour + HOUR) == {hour - 5 * HOUR: 1, hour - HOUR: 2}


def test_a_write_between_the_rollup_s_read_and_its_clear_keeps_its_mark(any_store):
    dev = _device(any_store)
    old = 1_700_000_000.0 - 1_700_000_000.0 % HOUR
    write_samples(any_store, *_rows(dev, [old + 1, old + HOUR + 1]))
    seen = late_hours.marks(any_store, old + 2 * HOUR)  # what a rollup reads before its samples
    assert seen == {old: 1, old + HOUR: 1}
    write_samples(any_store, *_rows(dev, [old + 2]))  # a late write while it rolls up
    assert late_hours.clear(any_store, seen) == 1
    assert late_hours.marks(any_store, old + 2 * HOUR) == {old: 2}  # the next rollup rolls it up again


def test_columnar_writes_mark_too(any_store):
    dev = _device(any_store)
    old = 1_700_000_000.0 - 1_700_000_000.0 % HOUR
    device = pa.record_batch({"device_id": pa.array([dev, dev], pa.int64()),
                              "ts": pa.array([old + 10, old + 3 * HOUR], pa.float64())})
    assert write_sample_batches(any_store, device, None) == (2, 0)
    assert late_hours.marks(any_store, old + 4 * HOUR) == {old: 1, old + 3 * HOUR: 1}
