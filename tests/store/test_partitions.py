"""PostgreSQL day partitions of the sample tables: rows land in their day, early rows are caught and moved,
a missing partition, a read-only or a full database refuses a batch whole with a clear error, retention drops whole days
only when every hour of them is rolled up, and `upgrade` from 0001 keeps every row."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from unittest import mock

import pytest
from sqlalchemy import event, func, select, text

from analyzer.periodic import rollup_hours
from analyzer.rollups import _rolled_up_rows, apply_retention, rollup
from collector.spool import Spool
from store.db import Store
from store.errors import DatabaseBusy, DatabaseFull, DatabaseReadOnly, DatabaseUnavailable, PartitionMissing
from store.ingest import write_samples
from store.migrations import head_revision, upgrade
from store.models import DeviceSample, ProcessSample, Workflow
from store.partitions import (
    DAY,
    Partition,
    adopt_early_rows,
    create_day,
    day_of,
    default_name,
    drop_days_before,
    ensure_partitions,
    partition_name,
    partitions,
)
from store.registry import DeviceSpec, register_devices, register_host
from store.settings import Settings
from store.workflows import upsert_workflow

GIB = 2**30


def fleet(store: Store, now: float) -> int:
    with store.session() as s:
        register_host(s, "h1", hostname="h1", source="replay", now=now)
        upsert_workflow(s, "wf", now=now)
        return register_devices(s, "h1", [DeviceSpec(0, "GPU-p-0", "T4", 16 * GIB)], source="replay", now=now)[0]


def rows(device: int, times: list[float]) -> tuple[list[dict], list[dict]]:
    return ([{"device_id": device, "ts": t, "gpu_util": 0.5, "mem_used": GIB, "mem_total": 16 * GIB} for t in times],
            [{"device_id": device, "workflow_id": "wf", "host_id": "h1", "pid": 7, "ts": t, "mem_used": GIB}
             for t in times])


def count(store: Store, table: str) -> int:
    with store.engine.connect() as conn:
        return conn.execute(text(f"SELECT count(*) FROM {table}")).scalar()


@pytest.mark.pg
def test_rows_land_in_their_day_and_early_rows_move_in_when_their_day_is_made(pg_store: Store) -> None:
    now = time.time()
    today = day_of(now)
    device = fleet(pg_store, now)
    with pg_store.engine.connect() as conn:
        names = {p.name for p in partitions(conn, "device_samples")}
    assert {partition_name("device_samples", today + k * DAY) for k in range(3)} | {
        default_name("device_samples")} <= names
    ahead = today + 10 * DAY + 3600  # an agent whose clock runs ten days ahead
    write_samples(pg_store, *rows(device, [now - 60, now, ahead]))
    assert count(pg_store, partition_name("device_samples", today)) == 2
    assert count(pg_store, default_name("device_samples")) == 1
    assert count(pg_store, default_name("process_samples")) == 1
    created = adopt_early_rows(pg_store)
    assert set(created) == {partition_name(t, today + 10 * DAY) for t in ("device_samples", "process_samples")}
    assert count(pg_store, default_name("device_samples")) == 0 == count(pg_store, default_name("process_samples"))
    assert count(pg_store, partition_name("device_samples", today + 10 * DAY)) == 1
    assert count(pg_store, "device_samples") == 3 == count(pg_store, "process_samples")
    assert ensure_partitions(pg_store, now, now) == []  # idempotent


@pytest.mark.pg
def test_rows_no_day_can_hold_stay_in_the_default_and_stop_no_other_day_from_moving(pg_store: Store,
                                                                                     fleet_home) -> None:
    """A clock in milliseconds, or one gone infinite, made a day partition's name fail (year 58000) and with it
    every hourly rollup, which moves early rows first."""
    now = time.time()
    today = day_of(now)
    device = fleet(pg_store, now)
    ahead = today + 10 * DAY + 3600
    write_samples(pg_store, *rows(device, [now * 1000, float("inf"), -1e12, ahead]))
    summary = rollup_hours(pg_store, Settings(), now=now)
    assert set(summary["partitions_created"]) == {partition_name(t, today + 10 * DAY)
                                                  for t in ("device_samples", "process_samples")}
    assert count(pg_store, partition_name("device_samples", today + 10 * DAY)) == 1
    assert count(pg_store, default_name("device_samples")) == 3 == count(pg_store, default_name("process_samples"))
    assert count(pg_store, "device_samples") == 4


def waiting_on_a_lock(store: Store, backend: Callable[[], int | None],
                      done: Callable[[], bool] = lambda: False) -> None:
    """Return once the backend whose pid `backend` gives (None: not connected yet) waits for a lock, or once its
    writer is `done` without having waited."""
    with store.engine.connect() as watch:
        for _ in range(600):
            if done():
                return
            pid = backend()
            waiting = pid is not None and watch.execute(text(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = :p AND wait_event_type = 'Lock'"),
                {"p": pid}).scalar()
            watch.rollback()  # pg_stat_activity is read once per transaction
            if waiting:
                return
            time.sleep(0.05)
    pytest.fail("the other writer never waited for a lock")


@pytest.mark.pg
def test_a_batch_written_while_its_day_is_attached_is_kept_for_the_next_try(pg_store: Store) -> None:
    """Its row, routed to the default partition before the day was attached, was refused as invalid data: a spooled
    batch sent then was set aside as poison and lost."""
    now = time.time()
    device = fleet(pg_store, now)
    day = day_of(now) + 5 * DAY  # rows of a day nobody made yet wait in the default partition
    write_samples(pg_store, *rows(device, [day + 10]))
    failed: list[BaseException] = []

    pids: list[int] = []

    def note_pid(conn, _record) -> None:
        cur = conn.cursor()
        cur.execute("SELECT pg_backend_pid()")
        pids.append(cur.fetchone()[0])
        cur.close()

    writer_store = Store(pg_store.url)
    event.listen(writer_store.engine, "connect", note_pid)

    def write() -> None:
        try:
            write_samples(writer_store, *rows(device, [day + 20]))
        except BaseException as exc:
            failed.append(exc)

    writer = threading.Thread(target=write)
    with pg_store.engine.begin() as conn:
        assert create_day(conn, "device_samples", day)  # holds the default partition locked until it commits
        writer.start()
        waiting_on_a_lock(pg_store, lambda: pids[0] if pids else None)  # for the default partition
    writer.join(30)
    writer_store.dispose()
    assert len(failed) == 1 and isinstance(failed[0], DatabaseBusy)  # kept (spooled) and sent again, not set aside
    assert count(pg_store, "device_samples") == 1
    write_samples(pg_store, *rows(device, [day + 20]))  # the next try lands in its day
    assert count(pg_store, partition_name("device_samples", day)) == 2


@pytest.mark.pg
def test_two_rollups_making_the_same_day_at_once_both_succeed(pg_store: Store) -> None:
    """The second one's CREATE TABLE failed on the catalog's unique name once the first committed."""
    day = day_of(time.time()) + 6 * DAY
    outcome: list[object] = []

    pids: list[int] = []

    def second() -> None:
        try:
            with pg_store.engine.begin() as conn:
                pids.append(conn.execute(text("SELECT pg_backend_pid()")).scalar())
                outcome.append(create_day(conn, "device_samples", day))
        except BaseException as exc:
            outcome.append(exc)

    other = threading.Thread(target=second)
    with pg_store.engine.begin() as conn:
        assert create_day(conn, "device_samples", day)
        other.start()
        waiting_on_a_lock(pg_store, lambda: pids[0] if pids else None)
    other.join(30)
    assert outcome == [False]


@pytest.mark.pg
def test_a_missing_partition_refuses_the_whole_batch_until_it_is_made(pg_store: Store) -> None:
    now = time.time()
    device = fleet(pg_store, now)
    with pg_store.engine.begin() as conn:  # no default partition and no partition for the day after tomorrow + 5
        conn.execute(text(f"ALTER TABLE process_samples DETACH PARTITION {default_name('process_samples')}"))
    far = day_of(now) + 8 * DAY
    with pytest.raises(PartitionMissing, match="fleetlens init") as err:
        write_samples(pg_store, *rows(device, [now, far]))
    assert isinstance(err.value, DatabaseUnavailable)  # the agent keeps the batch spooled, as through an outage
    assert count(pg_store, "device_samples") == 0 == count(pg_store, "process_samples")  # nothing half-written
    ensure_partitions(pg_store, far, far, days_ahead=0)
    assert write_samples(pg_store, *rows(device, [now, far])) == (2, 2)


@pytest.mark.pg
def test_a_read_only_database_refuses_writes_clearly_and_the_spool_keeps_them(pg_url: str, pg_store: Store,
                                                                               tmp_path) -> None:
    now = time.time()
    device = fleet(pg_store, now)
    read_only = Store(pg_url + "%20-cdefault_transaction_read_only%3Don")
    try:
        with pytest.raises(DatabaseReadOnly, match="read-only"):
            write_samples(read_only, *rows(device, [now]))
        with pytest.raises(DatabaseReadOnly, match="writable again"), read_only.session() as s:
            s.get(Workflow, "wf").last_seen = now + 1
        spool = Spool(tmp_path / "spool", 1 << 20)
        spool.put({"batch": 1}, rows=2)

        def send(_batch: dict) -> None:
            write_samples(read_only, *rows(device, [now]))

        with pytest.raises(DatabaseReadOnly):
            spool.drain(send, on_poison=lambda *_: pytest.fail("a read-only database must not poison a batch"))
        assert len(spool) == 1 and spool.dropped_rows == 0
    finally:
        read_only.dispose()
    assert count(pg_store, "device_samples") == 0
    with pg_store.session() as s:
        assert s.get(Workflow, "wf").last_seen == pytest.approx(now)


@pytest.mark.pg
def test_retention_drops_a_whole_day_only_when_every_hour_of_it_is_rolled_up(pg_store: Store) -> None:
    now = time.time()
    device = fleet(pg_store, now - 5 * DAY)
    old_day = day_of(now) - 4 * DAY
    ensure_partitions(pg_store, old_day, old_day, days_ahead=0)
    minutes = [old_day + 60.0 * m for m in range(0, 24 * 60, 10)]  # every 10 min over the whole day
    write_samples(pg_store, *rows(device, minutes))
    write_samples(pg_store, *rows(device, [now - 60]))
    kept_back = apply_retention(pg_store, 2.0, now)  # nothing rolled up: the day stays
    assert kept_back.partitions_dropped == () and kept_back.device_samples_deleted == 0
    rollup(pg_store, now, since=old_day)
    done = apply_retention(pg_store, 2.0, now)
    assert set(done.partitions_dropped) == {partition_name(t, old_day) for t in ("device_samples", "process_samples")}
    assert done.device_samples_deleted == len(minutes) == done.process_samples_deleted
    with pg_store.session() as s:
        assert s.scalar(select(func.count()).select_from(DeviceSample)) == 1
        assert s.scalar(select(func.count()).select_from(ProcessSample)) == 1


@pytest.mark.pg
def test_a_sample_late_for_a_day_the_retention_dropped_is_deleted_by_the_next_run(pg_store: Store) -> None:
    """A spool sent after its day's partition was dropped lands in the default partition; no rollup takes it (its day
    is past the look-back), and the retention kept it there for good."""
    now = time.time()
    device = fleet(pg_store, now - 5 * DAY)
    old_day = day_of(now) - 4 * DAY
    ensure_partitions(pg_store, old_day, old_day, days_ahead=0)
    write_samples(pg_store, *rows(device, [old_day + 60.0 * m for m in range(0, 24 * 60, 10)]))
    write_samples(pg_store, *rows(device, [now - 60]))
    rollup(pg_store, now, since=old_day)
    assert apply_retention(pg_store, 2.0, now).partitions_dropped
    write_samples(pg_store, *rows(device, [old_day + 3 * 3600.0 + 30]))  # late, for the dropped day
    rollup(pg_store, now, recheck_days=2.0)  # as the periodic job runs them: the look-back is the retention's
    late = apply_retention(pg_store, 2.0, now)
    with pg_store.session() as s:
        assert s.scalar(select(func.count()).select_from(DeviceSample).where(DeviceSample.ts < late.cutoff)) == 0
        assert s.scalar(select(func.count()).select_from(ProcessSample).where(ProcessSample.ts < late.cutoff)) == 0
    assert (late.device_samples_deleted, late.process_samples_deleted, late.late_samples_deleted) == (1, 1, 2)


@pytest.mark.pg
def test_a_late_sample_written_while_retention_drops_its_day_is_not_lost(pg_store: Store) -> None:
    """A late batch (a spool sent after a long outage) committed between retention's check that the day is rolled up
    and its drop went with the day, never rolled up."""
    now = time.time()
    device = fleet(pg_store, now - 12 * DAY)
    old_day = day_of(now) - 10 * DAY
    ensure_partitions(pg_store, old_day, old_day, days_ahead=0)
    write_samples(pg_store, *rows(device, [old_day + 600.0 * k for k in range(6)]))
    rollup(pg_store, now, since=old_day)
    late_row = ([{"device_id": device, "ts": old_day + 30.0, "gpu_util": 0.9}], [])
    pids: list[int] = []
    failed: list[BaseException] = []
    writer_store = Store(pg_store.url)
    event.listen(writer_store.engine, "connect", lambda conn, _r: pids.append(conn.info.backend_pid))

    def write_late() -> None:
        try:
            write_samples(writer_store, *late_row)
        except BaseException as exc:
            failed.append(exc)

    writer = threading.Thread(target=write_late)

    def checked_then_a_late_write(conn, part: Partition) -> int | None:
        rows_held = _rolled_up_rows(conn, part)
        if part.table == "device_samples":
            writer.start()
            # it waits for this day (it went straight in, and was dropped with the day, when nothing held it back)
            waiting_on_a_lock(pg_store, lambda: pids[0] if pids else None, lambda: not writer.is_alive())
        return rows_held

    try:
        drop_days_before(pg_store, old_day + DAY, checked_then_a_late_write)
        writer.join(30)
    finally:
        writer_store.dispose()
    if failed:  # the writer was the deadlock's victim: the agent keeps the batch and sends it again
        assert isinstance(failed[0], DatabaseBusy)
        write_samples(pg_store, *late_row)
    with pg_store.session() as s:
        assert s.scalar(select(func.count()).select_from(DeviceSample).where(DeviceSample.gpu_util == 0.9)) == 1


@pytest.mark.pg
def test_upgrading_from_0001_keeps_every_row(pg_url: str) -> None:
    """0002 partitions the tables, ids kept and their sequence going on; 0006 then drops the ids, rows kept."""
    store = Store(pg_url)
    try:
        upgrade(store, "0001")
        now = time.time()
        # the workflow row as revision 0001 had it (the model has columns later revisions add)
        with store.engine.begin() as conn:
            conn.execute(text("INSERT INTO workflows (id, id_source, labels, managed, movable, gpus, state, "
                              "created_at, last_seen) VALUES ('wf', 'env', '{}', false, false, 0, 'running', :t, :t)"),
                         {"t": now})
        with store.session() as s:
            register_host(s, "h1", hostname="h1", source="replay", now=now)
            device = register_devices(s, "h1", [DeviceSpec(0, "GPU-p-0", "T4", 16 * GIB)], source="replay",
                                      now=now)[0]
        with mock.patch("store.late_hours.mark"):  # as a writer of 0001 wrote (late-hour marks come with 0017)
            write_samples(store, *rows(device, [now - 3 * DAY, now - 60, now]))
        with store.engine.connect() as conn:
            before = conn.execute(text("SELECT id, ts FROM device_samples ORDER BY id")).all()
        assert upgrade(store, "0005") == "0005"
        with store.engine.connect() as conn:
            after = conn.execute(text("SELECT id, ts FROM device_samples ORDER BY id")).all()
            assert conn.execute(text("SELECT count(*) FROM process_samples")).scalar() == 3
        assert after == before
        assert count(store, partition_name("device_samples", day_of(now - 3 * DAY))) == 1
        # the id sequence carries on (a writer of 0005 marks no late hour either: within a minute of the hour's end
        # today's writer marks the hour it writes into, and revision 0005 has no table for the mark)
        with mock.patch("store.late_hours.mark"):
            write_samples(store, *rows(device, [now + 1]))
        with store.engine.connect() as conn:
            assert conn.execute(text("SELECT max(id) FROM device_samples")).scalar() > before[-1][0]
        assert upgrade(store) == head_revision()
        with store.engine.connect() as conn:
            assert conn.execute(text("SELECT ts FROM device_samples ORDER BY ts")).scalars().all() == sorted(
                [ts for _, ts in before] + [now + 1])
        assert count(store, "process_samples") == 4
    finally:
        store.dispose()


def test_a_full_database_refuses_the_batch_whole_and_says_so(tmp_path) -> None:
    """SQLite at its page limit stands for a disk that filled up: the same error, the same nothing-written."""
    store = Store(f"sqlite:///{tmp_path / 'full.db'}")
    upgrade(store)
    now = time.time()
    device = fleet(store, now)
    write_samples(store, *rows(device, [now]))
    with store.engine.connect() as conn:
        pages = conn.exec_driver_sql("PRAGMA page_count").scalar()
    store.dispose()
    event.listen(store.engine, "connect", lambda c, _r: c.execute(f"PRAGMA max_page_count = {pages + 2}"))
    big = [now + k for k in range(1, 5000)]
    with pytest.raises(DatabaseFull, match="is full") as err:
        write_samples(store, *rows(device, big))
    assert isinstance(err.value, DatabaseUnavailable)  # the agent spools it, as through an outage
    with store.session() as s:
        assert s.scalar(select(func.count()).select_from(DeviceSample)) == 1
        assert s.scalar(select(func.count()).select_from(ProcessSample)) == 1
    store.dispose()
