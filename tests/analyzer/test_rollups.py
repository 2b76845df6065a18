"""Hourly rollups: the numbers, idempotent upserts on SQLite and PostgreSQL, and a retention that never loses an
hour that was not rolled up."""

from __future__ import annotations

import pandas as pd
import pytest
from sqlalchemy import event, func, select

from analyzer import periodic
from analyzer.rollups import apply_retention, rollup
from analyzer.telemetry.hour_summaries import kept_hours
from analyzer.telemetry.thresholds import load_thresholds
from store.db import Store
from store.errors import InvalidInput
from store.migrations import upgrade
from store.models import DeviceSample, ProcessSample, Rollup, TelemetryHour
from store.settings import Settings
from tests.analyzer.telemetry_fleet import GIB, T0, Fleet

HOUR = 3600.0


def _rows(store) -> pd.DataFrame:
    with store.engine.connect() as conn:
        frame = pd.read_sql_query(select(Rollup).order_by(Rollup.scope, Rollup.subject, Rollup.hour), conn)
    return frame.drop(columns=["id", "computed_at"])


def _count(store, model) -> int:
    with store.session() as s:
        return s.scalar(select(func.count()).select_from(model))


def _three_hours(store) -> tuple[Fleet, int, int]:
    fleet = Fleet(store)
    busy, shared = fleet.device(), fleet.device()
    fleet.workflow("busy", team="vision")
    fleet.workflow("a", team="llm")
    fleet.workflow("b", team="llm")
    fleet.run(busy, "busy", 0, 60, util=0.8, mem_gib=70, sm_active=0.6)
    fleet.run(busy, "busy", 60, 180, util=0.0, mem_gib=70, sm_active=0.0)
    fleet.run(shared, "a", 0, 180, util=0.5, mem_gib=40, wf_mem_gib=30, pid=1)
    fleet.run(shared, "b", 0, 180, util=0.5, mem_gib=40, wf_mem_gib=10, pid=2, device_rows=False)
    fleet.flush()
    return fleet, busy, shared


def test_rollup_numbers(sqlite_store):
    _, busy, shared = _three_hours(sqlite_store)
    result = rollup(sqlite_store, now=T0 + 3 * HOUR + 60)
    assert (result.hours, result.device_rows, result.workflow_rows) == (3, 6, 9)
    rows = _rows(sqlite_store).set_index(["scope", "subject", "hour"])
    first = rows.loc[("device", str(busy), T0)]
    assert first.samples == 60 and first.gpu_hours_held == pytest.approx(1.0)
    assert first.gpu_hours_active == pytest.approx(0.8) and first.util_p95 == pytest.approx(0.8)
    assert first.sm_active_mean == pytest.approx(0.6)
    assert first.mem_peak == 70 * GIB and first.mem_total == 80 * GIB and first.team is None
    assert rows.loc[("device", str(busy), T0 + HOUR)].gpu_hours_active == pytest.approx(0.0)
    wf = rows.loc[("workflow", "busy", T0)]
    assert wf.team == "vision" and wf.samples == 60 and wf.gpu_hours_held == pytest.approx(1.0)
    # two workflows on one device split it: each holds half, together the device's hour
    a, b = rows.loc[("workflow", "a", T0)], rows.loc[("workflow", "b", T0)]
    assert a.gpu_hours_held == pytest.approx(0.5) and b.gpu_hours_held == pytest.approx(0.5)
    assert a.gpu_hours_active == pytest.approx(0.25)  # held x utilisation, per share
    assert a.mem_peak == 30 * GIB and b.mem_peak == 10 * GIB and a.team == "llm"
    assert rows.loc[("device", str(shared), T0)].gpu_hours_held == pytest.approx(1.0)


def test_only_closed_hours_are_rolled_up(sqlite_store):
    _three_hours(sqlite_store)
    result = rollup(sqlite_store, now=T0 + 2 * HOUR + 1800)  # the third hour is still open
    assert result.hours == 2 and result.last_hour == T0 + HOUR
    assert set(_rows(sqlite_store)["hour"]) == {T0, T0 + HOUR}
    assert rollup(sqlite_store, now=T0 + 10).hours == 0  # nothing closed yet before the first hour ends


def test_rollup_twice_gives_the_same_rows(any_store):
    _three_hours(any_store)
    rollup(any_store, now=T0 + 3 * HOUR, since=T0)
    before = _rows(any_store)
    rollup(any_store, now=T0 + 3 * HOUR, since=T0)
    again = rollup(any_store, now=T0 + 3 * HOUR)  # default: from the hour after the last rolled one
    after = _rows(any_store)
    assert (again.hours, again.device_rows, again.workflow_rows, again.rerolled_hours) == (0, 0, 0, ())
    assert len(before) == 15
    pd.testing.assert_frame_equal(before, after)


def test_late_samples_update_the_hour(any_store):
    fleet, busy, _ = _three_hours(any_store)
    rollup(any_store, now=T0 + 3 * HOUR)
    # a late batch for the last hour: the next rollup finds the hour outgrown by its samples and rolls it up again
    fleet.run(busy, "busy", 179, 180, util=1.0, mem_gib=79)
    fleet.flush()
    rollup(any_store, now=T0 + 3 * HOUR)
    row = _rows(any_store).set_index(["scope", "subject", "hour"]).loc[("device", str(busy), T0 + 2 * HOUR)]
    assert row.samples == 61 and row.mem_peak == 79 * GIB


def test_retention_deletes_only_rolled_up_hours(any_store):
    fleet, busy, _ = _three_hours(any_store)
    now = T0 + 3 * HOUR + 60
    # nothing rolled up: a retention of one hour must keep everything
    kept = apply_retention(any_store, 1 / 24, now=now)
    assert (kept.device_samples_deleted, kept.process_samples_deleted) == (0, 0) and kept.hours_kept > 0
    assert _count(any_store, DeviceSample) == 360 and _count(any_store, ProcessSample) == 540

    rollup(any_store, now=T0 + HOUR)  # only the first hour
    result = apply_retention(any_store, 1 / 24, now=now)  # cutoff: T0 + 2 h
    assert result.cutoff == T0 + 2 * HOUR
    assert (result.device_samples_deleted, result.process_samples_deleted) == (120, 180)
    with any_store.session() as s:
        assert s.scalar(select(func.min(DeviceSample.ts))) == T0 + HOUR  # the second hour was not rolled up

    # a sample arrives late for the second hour after it was rolled up: the next rollup rolls the hour up again (it
    # is marked, within the look-back), and the retention then deletes it whole, the late sample with it
    rollup(any_store, now=T0 + 2 * HOUR)
    fleet.run(busy, "busy", 90, 91, util=0.3, mem_gib=70)
    fleet.flush()
    assert rollup(any_store, now=T0 + 2 * HOUR).rerolled_hours == (T0 + HOUR,)
    done = apply_retention(any_store, 1 / 24, now=now)
    assert (done.device_samples_deleted, done.process_samples_deleted, done.late_samples_deleted) == (121, 181, 0)
    with any_store.session() as s:
        assert s.scalar(select(func.min(DeviceSample.ts))) == T0 + 2 * HOUR
        assert s.scalar(select(func.min(ProcessSample.ts))) == T0 + 2 * HOUR
    assert len(_rows(any_store)) == 10  # rollups themselves are never deleted
    # the detectors' kept hours go with their samples: none is kept from before the cutoff (T0 + 2 h); the first
    # hour, its samples deleted, is not rolled up (nor summarised) again
    assert (result.summaries_deleted, done.summaries_deleted) == (1, 1)
    with any_store.session() as s:
        assert s.scalar(select(func.count()).select_from(TelemetryHour)) == 0


def test_a_sample_that_arrives_while_the_retention_deletes_its_hour_is_not_deleted_unrolled(any_store):
    """The retention counts an hour's rows, then deletes them: a late sample committed in between was never rolled
    up, and went with the others."""
    fleet, busy, _ = _three_hours(any_store)
    rollup(any_store, now=T0 + 3 * HOUR)
    late = {"written": False}

    def late_write(conn, cursor, statement, *args) -> None:
        if not late["written"] and statement.lstrip().upper().startswith("DELETE FROM DEVICE_SAMPLES"):
            late["written"] = True
            fleet.run(busy, "busy", 30, 31, util=0.3, mem_gib=70, device_rows=True)  # on another connection
            fleet.flush()

    event.listen(any_store.engine, "before_cursor_execute", late_write)
    try:
        result = apply_retention(any_store, 1 / 24, now=T0 + 3 * HOUR + 60)  # cutoff: T0 + 2 h
    finally:
        event.remove(any_store.engine, "before_cursor_execute", late_write)
    assert late["written"], "the retention deleted no device sample row by row: nothing tested"
    with any_store.session() as s:
        at = s.scalar(select(func.count()).select_from(DeviceSample).where(DeviceSample.ts == T0 + 30 * 60))
    assert at == 3  # both devices' samples of that minute, and the late one: nothing went unrolled
    assert result.device_samples_deleted == 0
    # the hour the late sample changed is older than the cutoff: no rollup rolls it up again, so its rows are past
    # the retention, counted as late: its process rows in this run (the process samples' turn came after the late
    # write), its device rows in the next, with what matches its rollups
    assert result.late_samples_deleted == 61
    again = apply_retention(any_store, 1 / 24, now=T0 + 3 * HOUR + 60)
    assert (again.device_samples_deleted, again.hours_kept, again.late_samples_deleted) == (241, 0, 61)
    with any_store.session() as s:
        assert s.scalar(select(func.count()).select_from(DeviceSample).where(DeviceSample.ts < T0 + 2 * HOUR)) == 0


def _rollup_of(store, scope: str, subject, hour: float):
    rows = _rows(store).set_index(["scope", "subject", "hour"])
    key = (scope, str(subject), hour)
    return rows.loc[key] if key in rows.index else None


def test_samples_that_come_late_for_an_older_rolled_hour_are_rolled_up_again(any_store):
    """An agent cut off from the database spools its samples and sends them hours later; a rollup that started from
    the last rolled hour never read them, and the waste and rank, which read rollups, undercounted the hour."""
    fleet = Fleet(any_store)
    live, cut_off = fleet.device("h1"), fleet.device("h2")
    fleet.workflow("train")
    fleet.workflow("resumed")
    fleet.workflow("side")
    fleet.run(live, "train", 0, 180, util=0.8, mem_gib=70)
    fleet.run(cut_off, "resumed", 120, 180, util=0.9, mem_gib=60, pid=7)  # h2 writes again in the third hour
    fleet.flush()
    first = rollup(any_store, now=T0 + 3 * HOUR)
    assert first.hours == 3
    with any_store.session() as s:
        kept_before = s.scalar(select(TelemetryHour.computed_at).where(TelemetryHour.hour == T0))

    # h2's spool arrives: device and process samples of the first hour; and, of the second hour, process samples of
    # a workflow on h1 whose device samples were written in time
    fleet.run(cut_off, "resumed", 0, 60, util=0.9, mem_gib=60, pid=7)
    fleet.run(live, "side", 60, 120, util=0.8, mem_gib=70, wf_mem_gib=5, pid=8, device_rows=False)
    fleet.flush()
    again = rollup(any_store, now=T0 + 3 * HOUR)
    late_device = _rollup_of(any_store, "device", cut_off, T0)
    assert late_device is not None, "the late samples of the first hour were never rolled up"
    assert late_device.samples == 60 and late_device.gpu_hours_held == pytest.approx(1.0)
    late_workflow = _rollup_of(any_store, "workflow", "resumed", T0)
    assert late_workflow is not None and late_workflow.samples == 60
    assert late_workflow.gpu_hours_held == pytest.approx(1.0)
    side = _rollup_of(any_store, "workflow", "side", T0 + HOUR)
    assert side is not None and side.samples == 60
    assert side.gpu_hours_held == pytest.approx(0.5)  # shares h1 with train
    assert again.hours == 0 and again.rerolled_hours == (T0, T0 + HOUR)
    assert _rollup_of(any_store, "workflow", "train", T0 + HOUR).gpu_hours_held == pytest.approx(0.5)
    assert _rollup_of(any_store, "workflow", "train", T0).gpu_hours_held == pytest.approx(1.0)
    # the detectors' summary of the hour is replaced too: it now holds h2's hour
    th = load_thresholds()
    (piece,) = kept_hours(any_store, T0, T0 + HOUR, th)
    assert set(piece.pairs["device_id"].astype(int)) == {live, cut_off}
    with any_store.session() as s:
        assert s.scalar(select(TelemetryHour.computed_at).where(TelemetryHour.hour == T0)) > kept_before

    # nothing came since: nothing is rolled up again
    idle = rollup(any_store, now=T0 + 3 * HOUR)
    assert (idle.hours, idle.device_rows, idle.workflow_rows, idle.rerolled_hours) == (0, 0, 0, ())

    # the re-rolled hours match their samples again: the retention deletes them whole
    kept = apply_retention(any_store, 1 / 24, now=T0 + 3 * HOUR)  # cutoff: T0 + 2 h
    assert (kept.device_samples_deleted, kept.process_samples_deleted, kept.hours_kept) == (180, 240, 0)
    # an hour the retention has deleted holds fewer samples than its rollups counted: it is not rolled up again
    before = _rows(any_store)
    after_retention = rollup(any_store, now=T0 + 3 * HOUR)
    assert after_retention.rerolled_hours == () and after_retention.device_rows == 0
    pd.testing.assert_frame_equal(before, _rows(any_store))


def test_the_look_back_bounds_which_hours_are_checked(sqlite_store):
    fleet = Fleet(sqlite_store)
    dev = fleet.device()
    fleet.workflow("w")
    fleet.run(dev, "w", 0, 180, util=0.5, mem_gib=40)
    fleet.flush()
    rollup(sqlite_store, now=T0 + 3 * HOUR)
    fleet.run(dev, "w", 0, 1, util=0.5, mem_gib=40, pid=2)  # a second process's late sample of the first hour
    fleet.flush()
    # the last hour only: the first hour is not counted, so not rolled up again
    short = rollup(sqlite_store, now=T0 + 3 * HOUR, recheck_days=1 / 24)
    none = rollup(sqlite_store, now=T0 + 3 * HOUR, recheck_days=0)
    assert (short.rerolled_hours, short.workflow_rows, none.rerolled_hours) == ((), 0, ())
    assert _rollup_of(sqlite_store, "workflow", "w", T0).samples == 60
    assert rollup(sqlite_store, now=T0 + 3 * HOUR, recheck_days=3 / 24).rerolled_hours == (T0,)
    assert _rollup_of(sqlite_store, "workflow", "w", T0).samples == 61


def test_recheck_days_must_be_a_number_of_days(sqlite_store):
    for bad in (-1, None, float("nan"), float("inf")):
        with pytest.raises(InvalidInput, match="recheck_days"):
            rollup(sqlite_store, now=T0, recheck_days=bad)


def test_retention_rejects_a_bad_number(sqlite_store):
    for bad in (0, -1, None, float("nan"), float("inf")):  # inf: no cutoff hour to keep whole hours from
        with pytest.raises(InvalidInput, match="retention_days"):
            apply_retention(sqlite_store, bad)


def test_rollup_of_an_empty_store(sqlite_store):
    assert rollup(sqlite_store, now=T0).hours == 0
    assert apply_retention(sqlite_store, 7, now=T0).device_samples_deleted == 0


def test_rollup_jumps_over_months_without_samples(sqlite_store):
    fleet = Fleet(sqlite_store)
    dev = fleet.device()
    fleet.workflow("w")
    fleet.run(dev, "w", 0, 60, util=0.5, mem_gib=10)
    fleet.run(dev, "w", 90 * 24 * 60, 90 * 24 * 60 + 60, util=0.5, mem_gib=10)  # 90 days later
    fleet.flush()
    result = rollup(sqlite_store, now=T0 + 400 * 86400.0)  # more than a year of hours, nearly all empty
    assert (result.device_rows, result.workflow_rows) == (2, 2)
    assert set(_rows(sqlite_store)["hour"]) == {T0, T0 + 90 * 86400.0}


def test_an_in_memory_sqlite_store_is_rolled_up_in_the_calling_thread():
    """An in-memory SQLite database exists once per thread: a rollup that read it from a worker thread would see an
    empty database and roll up nothing."""
    store = Store("sqlite://")
    try:
        upgrade(store)
        _three_hours(store)
        result = rollup(store, now=T0 + 3 * HOUR)
        assert (result.hours, result.device_rows) == (3, 6)
        with store.session() as s:
            assert s.scalar(select(func.count()).select_from(TelemetryHour)) == 3
    finally:
        store.dispose()


def test_a_sample_late_for_an_hour_past_the_retention_is_deleted_not_kept_for_good(any_store, fleet_home):
    """A spool sent days late reaches an hour whose samples the retention has deleted: the rollup does not roll it up
    again (past its look-back, the retention's days) and its rows no longer match its rollups. They stayed for good,
    counted in hours_kept by every run."""
    settings = Settings(retention_days=2 / 24)
    fleet = Fleet(any_store)
    dev = fleet.device()
    fleet.workflow("w")
    fleet.run(dev, "w", 0, 240, util=0.5, mem_gib=40)
    fleet.flush()
    now = T0 + 4 * HOUR + 60  # cutoff: T0 + 2 h
    first = periodic.rollup_and_retain(any_store, settings, now=now)
    assert first["retention"]["device_samples_deleted"] == 120
    before = _rows(any_store)
    fleet.run(dev, "w", 30, 31, util=0.9, mem_gib=40, pid=7)  # late, for the first hour
    fleet.flush()
    for _ in range(2):  # the run that finds them deletes them; the next finds nothing left
        again = periodic.rollup_and_retain(any_store, settings, now=now)
        with any_store.session() as s:
            left = [s.scalar(select(func.count()).select_from(m).where(m.ts < T0 + 2 * HOUR))
                    for m in (DeviceSample, ProcessSample)]
        assert left == [0, 0]
        assert again["retention"]["hours_kept"] == 0
    assert again["retention"]["late_samples_deleted"] == 0
    pd.testing.assert_frame_equal(before, _rows(any_store))  # the hour's rollups stay as they were
