"""Bulk ingestion writes whole batches (COPY on PostgreSQL, executemany on SQLite) or nothing at all."""

from __future__ import annotations

import pytest
from sqlalchemy import func, select

from store.errors import InvalidInput
from store.ingest import write_samples
from store.models import DeviceSample, ProcessSample
from store.registry import DeviceSpec, register_devices, register_host
from store.samples import DEVICE_SAMPLE_COLUMNS, PROCESS_SAMPLE_COLUMNS, DeviceSampleRow, ProcessSampleRow


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
    assert DEVICE_SAMPLE_COLUMNS == tuple(c.name for c in DeviceSample.__table__.columns if c.name != "id")
    assert PROCESS_SAMPLE_COLUMNS == tuple(c.name for c in ProcessSample.__table__.columns if c.name != "id")


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
