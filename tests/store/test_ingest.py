"""Bulk ingestion writes whole batches (COPY on PostgreSQL, executemany on SQLite) or nothing at all."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from sqlalchemy import func, select

from store.errors import InvalidInput
from store.ingest import write_sample_batches, write_samples, write_samples_once
from store.models import DeviceSample, ProcessSample
from store.registry import DeviceSpec, register_devices, register_host
from store.samples import DEVICE_SAMPLE_COLUMNS, PROCESS_SAMPLE_COLUMNS, DeviceSampleRow, ProcessSampleRow
from store.workflows import upsert_workflow


def _device(store) -> int:
    with store.session() as s:
        register_host(s, "h1", hostname="h1", source="cpu")
        return register_devices(s, "h1", [DeviceSpec(0, "cpu-h1-0", "cpu 0", 8 << 30)], source="cpu")[0]


def test_batch_round_trips_with_missing_metrics_as_null(any_store):
    dev = _device(any_store)
    rows = [{"device_id": dev, "ts": 1000.0 + i, "gpu_util": i / 10, "mem_used": i << 20} for i in range(10)]
    procs = [{"device_id": dev, "workflow_id": "wf", "host_id": "h1", "pid": 42, "ts": 1000.0, "mem_used": 7}]
    assert write_samples(any_store, rows, procs) == (10, 1)
    with any_store.session() as s:
        samples = s.scalars(select(DeviceSample).order_by(DeviceSample.ts)).all()
        assert [r.gpu_util for r in samples] == pytest.approx([i / 10 for i in range(10)])
        assert samples[3].mem_used == 3 << 20
        assert samples[3].sm_active is None and samples[3].power_w is None
        assert s.scalar(select(ProcessSample.mem_used)) == 7


def test_the_sample_rows_are_the_tables_columns_in_order():
    """Ingestion writes columns in the rows' order: a table and its row must never drift apart."""
    assert DEVICE_SAMPLE_COLUMNS == tuple(c.name for c in DeviceSample.__table__.columns)
    assert PROCESS_SAMPLE_COLUMNS == tuple(c.name for c in ProcessSample.__table__.columns)


def test_typed_rows_are_written_as_they_are(any_store):
    dev = _device(any_store)
    rows = [DeviceSampleRow(dev, 5.0, gpu_util=0.5, mem_used=3)]
    procs = [ProcessSampleRow(dev, "wf", "h1", 42, 5.0, cpu_util=0.25)]
    assert write_samples(any_store, rows, procs) == (1, 1)
    with any_store.session() as s:
        assert s.execute(select(DeviceSample.gpu_util, DeviceSample.mem_used, DeviceSample.power_w)).one() == (
            0.5, 3, None)
        assert s.execute(select(ProcessSample.pid, ProcessSample.cpu_util)).one() == (42, 0.25)


def test_tuple_rows_and_a_generator_stream(any_store):
    dev = _device(any_store)
    n = len(DEVICE_SAMPLE_COLUMNS)

    def stream():
        for i in range(5000):
            row = [None] * n
            row[0], row[1], row[2] = dev, float(i), 0.5
            yield tuple(row)

    assert write_samples(any_store, stream()) == (5000, 0)
    with any_store.session() as s:
        assert s.scalar(select(func.count()).select_from(DeviceSample)) == 5000


def test_a_bad_row_writes_nothing_of_the_batch(any_store):
    dev = _device(any_store)
    good = [{"device_id": dev, "ts": float(i)} for i in range(100)]
    bad = [{"device_id": dev, "ts": None}]  # a sample without a time is refused (NOT NULL)
    with pytest.raises(InvalidInput, match="nothing of it was written"):
        write_samples(any_store, good + bad)
    with any_store.session() as s:
        assert s.scalar(select(func.count()).select_from(DeviceSample)) == 0


def test_wrong_width_tuple_is_refused(sqlite_store):
    with pytest.raises(ValueError, match="expected"):
        write_samples(sqlite_store, [(1, 2.0)])


def test_list_rows_in_column_order_as_the_agent_sends_them(any_store):
    dev = _device(any_store)
    rows = [[dev, float(i), 0.25] + [None] * (len(DEVICE_SAMPLE_COLUMNS) - 3) for i in range(50)]
    assert write_samples(any_store, rows) == (50, 0)
    with any_store.session() as s:
        assert s.scalar(select(func.sum(DeviceSample.gpu_util))) == pytest.approx(12.5)


def test_column_batches_are_written_like_rows(any_store):
    """Arrow batches (the Prometheus importer's columns): masked values and columns a batch lacks are NULL, integral
    floats become BIGINT, text columns are text; the same rows as write_samples would write."""
    dev = _device(any_store)
    ts = np.arange(1000.0, 1010.0)
    util = np.where(np.arange(10) % 3 == 0, np.nan, np.arange(10) / 10)
    device = pa.RecordBatch.from_arrays(
        [pa.array(np.full(10, dev)), pa.array(ts), pa.array(util, mask=np.isnan(util)),
         pa.array(np.arange(10.0) * (1 << 20))], names=["device_id", "ts", "gpu_util", "mem_used"])
    process = pa.RecordBatch.from_arrays(
        [pa.array([dev] * 2), pa.array(["wf-a", "wf-b"]), pa.array(["h1", "h1"]), pa.array([42, 43]),
         pa.array([1000.0, 1001.0]), pa.array([7, None], type=pa.int64())],
        names=["device_id", "workflow_id", "host_id", "pid", "ts", "mem_used"])
    assert write_sample_batches(any_store, device, process) == (10, 2)
    with any_store.session() as s:
        samples = s.execute(select(DeviceSample.gpu_util, DeviceSample.mem_used, DeviceSample.power_w)
                            .order_by(DeviceSample.ts)).all()
        procs = s.execute(select(ProcessSample.workflow_id, ProcessSample.pid, ProcessSample.mem_used,
                                 ProcessSample.cpu_util).order_by(ProcessSample.ts)).all()
    assert [u for u, _, _ in samples] == [None if np.isnan(u) else pytest.approx(u) for u in util]
    assert [m for _, m, _ in samples] == [i << 20 for i in range(10)] and {p for _, _, p in samples} == {None}
    assert procs == [("wf-a", 42, 7, None), ("wf-b", 43, None, None)]


def test_a_bad_column_batch_writes_nothing(any_store):
    dev = _device(any_store)
    device = pa.RecordBatch.from_arrays([pa.array([dev] * 3), pa.array([1.0, None, 3.0])], names=["device_id", "ts"])
    process = pa.RecordBatch.from_arrays([pa.array([dev]), pa.array(["wf"]), pa.array(["h1"]), pa.array([1]),
                                          pa.array([1.0])], names=["device_id", "workflow_id", "host_id", "pid", "ts"])
    with pytest.raises(InvalidInput, match="nothing of it was written"):
        write_sample_batches(any_store, process=process, device=device)
    with pytest.raises(ValueError, match="columns the table has not.*'temp'"):
        odd = pa.RecordBatch.from_arrays([pa.array([dev]), pa.array([1.0]), pa.array([5.0])],
                                         names=["device_id", "ts", "temp"])
        write_sample_batches(any_store, odd)
    with pytest.raises(InvalidInput, match="mem_used .* does not fit its int64 column, nothing of it was written"):
        write_sample_batches(any_store, pa.RecordBatch.from_arrays(
            [pa.array([dev]), pa.array([1.0]), pa.array([2.5])], names=["device_id", "ts", "mem_used"]))
    with any_store.session() as s:
        assert s.scalar(select(func.count()).select_from(DeviceSample)) == 0
        assert s.scalar(select(func.count()).select_from(ProcessSample)) == 0


def test_a_batch_written_once_adds_nothing_when_written_again(any_store):
    """A spooled batch sent again (its agent died before forgetting it) leaves out the rows the store holds."""
    with any_store.session() as s:
        register_host(s, "h", hostname="h", source="cpu")
        upsert_workflow(s, "wf")
        ids = register_devices(s, "h", [DeviceSpec(0, "u0", "d", 1), DeviceSpec(1, "u1", "d", 1)], source="cpu")
    device = [DeviceSampleRow(ids[i], 100.0 + t, gpu_util=0.5) for i in (0, 1) for t in range(3)]
    process = [ProcessSampleRow(ids[0], "wf", "h", pid, 100.0 + t) for pid in (7, 8) for t in range(3)]
    assert write_samples_once(any_store, device, process) == (6, 6)
    assert write_samples_once(any_store, device, process) == (0, 0)
    later = [DeviceSampleRow(ids[1], 103.0)]  # a row of the batch the store lacks still goes in
    assert write_samples_once(any_store, device + later, [*process, ProcessSampleRow(ids[0], "wf", "h", 9, 101.0)]) \
        == (1, 1)
    with any_store.session() as s:
        assert s.scalar(select(func.count()).select_from(DeviceSample)) == 7
        assert s.scalar(select(func.count()).select_from(ProcessSample)) == 7
