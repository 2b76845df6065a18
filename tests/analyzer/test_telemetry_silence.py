"""Findings of devices that stopped reporting: kept through an outage, resolved once the device has been silent longer
than the limit or the store shows their workflow moved away, with the reason in their evidence."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import select

from analyzer import periodic
from analyzer.ranking import findings_frame, rank_with_waste
from analyzer.telemetry import detect
from analyzer.telemetry.silence import last_reports
from store.db import Store
from store.migrations import upgrade
from store.models import Finding, Placement, Rollup
from store.settings import Settings
from tests.analyzer.telemetry_fleet import Fleet
from ui.cli import run

WINDOW = 3 * 3600
LIMIT = 12 * 3600


def _rows(store, wf: str) -> dict[tuple[int, str], tuple[int, str, dict]]:
    """(device, rule) -> (id, status, evidence) of the workflow's telemetry findings."""
    with store.session() as s:
        return {(f.device_id, f.rule): (f.id, f.status, f.evidence)
                for f in s.scalars(select(Finding).where(Finding.source == "telemetry", Finding.workflow_id == wf))}


def _statuses(store, wf: str, device: int | None = None) -> set[str]:
    return {s for (dev, _), (_, s, _) in _rows(store, wf).items() if device is None or dev == device}


def _idle_on_a_busy_on_b(store) -> tuple[Fleet, int, int]:
    """Host a holds its job idle for three hours, host b works hard; a's findings detected, one acknowledged."""
    fleet = Fleet(store)
    a, b = fleet.device(host="a"), fleet.device(host="b")
    fleet.workflow("on-a")
    fleet.workflow("on-b")
    fleet.run(a, "on-a", 0, 180, util=0.0, mem_gib=70)
    fleet.run(b, "on-b", 0, 180, util=0.95, mem_gib=70)
    fleet.flush()
    assert {f.workflow_id for f in detect(store, now=fleet.minute(180), window_s=WINDOW)} == {"on-a"}
    with store.session() as s:
        s.execute(Finding.__table__.update().where(Finding.workflow_id == "on-a", Finding.rule == "idle_holder")
                  .values(status="acknowledged", acted_by="ops"))
    return fleet, a, b


def _b_busy_until(fleet: Fleet, b: int, start_min: int, end_min: int) -> None:
    fleet.run(b, "on-b", start_min, end_min, util=0.95, mem_gib=70)
    fleet.flush()


def test_a_device_silent_past_the_limit_has_its_findings_resolved_and_they_stop_counting(any_store):
    fleet, a, b = _idle_on_a_busy_on_b(any_store)
    before = _rows(any_store, "on-a")
    # a is silent for nine hours: within the limit, its findings stay as they are, and count
    _b_busy_until(fleet, b, 180, 720)
    detect(any_store, now=fleet.minute(720), window_s=WINDOW, silent_limit_s=LIMIT)
    assert _rows(any_store, "on-a") == before
    ranked, w = rank_with_waste(any_store, fleet.minute(720))
    counted = ranked.set_index("workflow_id").loc["on-a"]
    assert counted["open_findings"] == len(before) and counted["recoverable_gpu_hours_per_day"] > 0
    assert w.recoverable_gpu_hours_per_day > 0 and set(findings_frame(any_store)["workflow_id"]) == {"on-a"}

    # thirteen hours: past the limit (its last sample at minute 179)
    _b_busy_until(fleet, b, 720, 960)
    detect(any_store, now=fleet.minute(960), window_s=WINDOW, silent_limit_s=LIMIT)
    after = _rows(any_store, "on-a")
    assert {s for _, s, _ in after.values()} == {"resolved"}
    reasons = [ev["resolution"] for _, _, ev in after.values()]
    assert {r["reason"] for r in reasons} == {"silent"}
    assert {(r["host"], r["last_report"], r["limit_s"], r["at"]) for r in reasons} == {
        ("a", fleet.minute(179), LIMIT, fleet.minute(960))}
    assert findings_frame(any_store).empty
    ranked, w = rank_with_waste(any_store, fleet.minute(960))
    assert w.recoverable_gpu_hours_per_day == 0
    on_a = ranked[ranked["workflow_id"] == "on-a"]
    assert on_a.empty or on_a[["open_findings", "recoverable_gpu_hours_per_day"]].values.tolist() == [[0, 0]]

    # a comes back with its job still idle: the same findings open again, as any finding found again
    fleet.run(a, "on-a", 960, 1140, util=0.0, mem_gib=70)
    _b_busy_until(fleet, b, 960, 1140)
    found = detect(any_store, now=fleet.minute(1140), window_s=WINDOW, silent_limit_s=LIMIT)
    assert {(f.device_id, f.rule): f.id for f in found} == {k: v[0] for k, v in before.items()}
    again = _rows(any_store, "on-a")
    assert {s for _, s, _ in again.values()} == {"open"}
    assert all("resolution" not in ev for _, _, ev in again.values())


def test_without_a_limit_a_silent_device_keeps_its_findings(sqlite_store):
    fleet, a, b = _idle_on_a_busy_on_b(sqlite_store)
    before = _rows(sqlite_store, "on-a")
    _b_busy_until(fleet, b, 180, 3000)  # two days silent
    for limit in (None, 0):
        detect(sqlite_store, now=fleet.minute(3000), window_s=WINDOW, silent_limit_s=limit)
        assert _rows(sqlite_store, "on-a") == before


def test_within_the_limit_a_silent_devices_findings_count_at_their_last_detections_cost(sqlite_store):
    """Once the device's samples have left the ranking's day, nothing bounds its findings but their own evidence: they
    count at what the last detection that saw the device gave them, however long it stays silent."""
    fleet, a, b = _idle_on_a_busy_on_b(sqlite_store)
    costs = []
    for minute in (1800, 2400, 3000):  # 27, 37 and 47 hours silent
        _b_busy_until(fleet, b, minute - 60, minute)
        detect(sqlite_store, now=fleet.minute(minute), window_s=WINDOW, silent_limit_s=3 * 86400)
        ranked, _ = rank_with_waste(sqlite_store, fleet.minute(minute))
        row = ranked.set_index("workflow_id").loc["on-a"]
        costs.append((row["recoverable_gpu_hours_per_day"], row["basis"]))
    assert costs[0][0] > 0 and costs == [costs[0]] * 3 and costs[0][1] == "detector window"


def test_samples_dated_ahead_of_the_run_count_as_a_report(sqlite_store):
    """A host whose clock runs ahead wrote samples later than the run's `now`: it cannot be taken as silent."""
    fleet, a, b = _idle_on_a_busy_on_b(sqlite_store)
    fleet.run(a, "on-a", 1200, 1210, util=0.0, mem_gib=70)  # dated past the run below
    _b_busy_until(fleet, b, 180, 960)
    detect(sqlite_store, now=fleet.minute(960), window_s=WINDOW, silent_limit_s=LIMIT)
    assert _statuses(sqlite_store, "on-a") == {"open", "acknowledged"}


def test_the_last_report_of_a_device_whose_samples_went_with_the_retention_is_its_last_rollup(sqlite_store):
    fleet = Fleet(sqlite_store)
    rolled, sampled, never = fleet.device(host="a"), fleet.device(host="a"), fleet.device(host="a")
    fleet.run(sampled, None, 0, 10, util=0.0, mem_gib=1)
    fleet.flush()
    with sqlite_store.session() as s:
        for device in (rolled, sampled):
            s.add(Rollup(scope="device", subject=str(device), hour=fleet.t0 - 7200, samples=60, gpu_hours_held=1.0,
                         gpu_hours_active=0.0, computed_at=fleet.t0))
        reports = last_reports(s, [rolled, sampled, never])
    assert reports == {rolled: fleet.t0 - 3600, sampled: fleet.minute(9), never: None}


def test_the_periodic_detection_resolves_a_device_silent_for_days_and_keeps_one_silent_for_a_day(sqlite_store,
                                                                                              tmp_path: Path):
    """The default limit, as `serve` and the DAG run it: three days, over a 24 h window."""
    settings = Settings(home=tmp_path)
    assert settings.silent_device_limit_s == 3 * 86400
    fleet, day = Fleet(sqlite_store), 1440
    a, b = fleet.device(host="a"), fleet.device(host="b")
    fleet.workflow("on-a")
    fleet.workflow("on-b")
    fleet.run(a, "on-a", 0, day, util=0.0, mem_gib=70)
    fleet.flush()
    periodic.detect_telemetry(sqlite_store, settings, now=fleet.minute(day))
    assert _statuses(sqlite_store, "on-a") == {"open"}
    for days_silent, expected in ((2, {"open"}), (4, {"resolved"})):
        fleet.run(b, "on-b", (days_silent + 1) * day - 60, (days_silent + 1) * day, util=0.95, mem_gib=70)
        fleet.flush()
        periodic.detect_telemetry(sqlite_store, settings, now=fleet.minute((days_silent + 1) * day))
        assert _statuses(sqlite_store, "on-a") == expected, days_silent


def test_fleetlens_detect_takes_the_limit_from_its_setting_and_findings_says_why(fleet_home, monkeypatch, capsys):
    assert run(["init"]) == 0
    store = Store(f"sqlite:///{fleet_home / 'fleetlens.db'}")
    upgrade(store)
    fleet, a, b = _idle_on_a_busy_on_b(store)
    _b_busy_until(fleet, b, 180, 960)
    detect_at = ["detect", "--now", str(fleet.minute(960)), "--window-hours", "3"]
    assert run(detect_at) == 0  # the default limit, three days: kept
    assert _statuses(store, "on-a") == {"open", "acknowledged"}
    monkeypatch.setenv("FLEETLENS_SILENT_DEVICE_LIMIT_S", str(LIMIT))
    assert run(detect_at) == 0
    assert _statuses(store, "on-a") == {"resolved"}
    capsys.readouterr()
    assert run(["findings", "--all"]) == 0
    assert "(resolved: silent)" in capsys.readouterr().out
    store.dispose()


# -- moved away -----------------------------------------------------------------------------------------------------


def test_a_workflow_moved_off_a_silent_host_by_its_placements_resolves_its_old_devices_findings(any_store):
    fleet, a, b = _idle_on_a_busy_on_b(any_store)
    c = fleet.device(host="c")
    with any_store.session() as s:
        s.add(Placement(workflow_id="on-a", device_id=a, host_id="a", state="active", started_at=fleet.t0))
    _b_busy_until(fleet, b, 180, 360)
    detect(any_store, now=fleet.minute(360), window_s=WINDOW, silent_limit_s=LIMIT)
    assert _statuses(any_store, "on-a") == {"open", "acknowledged"}  # still placed on a: a is only silent

    # the move is done (a migration, or a Slurm requeue as the import records it): off a, onto c
    with any_store.session() as s:
        s.execute(Placement.__table__.update().where(Placement.device_id == a)
                  .values(state="ended", ended_at=fleet.minute(370)))
        s.add(Placement(workflow_id="on-a", device_id=c, host_id="c", state="active", started_at=fleet.minute(370)))
    _b_busy_until(fleet, b, 360, 400)
    detect(any_store, now=fleet.minute(400), window_s=WINDOW, silent_limit_s=LIMIT)
    rows = _rows(any_store, "on-a")
    assert {s for _, s, _ in rows.values()} == {"resolved"}
    assert {(e["resolution"]["reason"], e["resolution"]["known_by"], e["resolution"]["now_on"])
            for _, _, e in rows.values()} == {("moved", "placement", f"device {c}")}


def test_placements_that_do_not_show_a_move_leave_a_silent_devices_findings(sqlite_store):
    fleet, a, b = _idle_on_a_busy_on_b(sqlite_store)
    c = fleet.device(host="c")
    _b_busy_until(fleet, b, 180, 360)
    with sqlite_store.session() as s:
        # placed on c only, never on a (the placements name its devices otherwise: no move of them shows here)
        s.add(Placement(workflow_id="on-a", device_id=c, host_id="c", state="active", started_at=fleet.t0))
    detect(sqlite_store, now=fleet.minute(360), window_s=WINDOW, silent_limit_s=LIMIT)
    assert _statuses(sqlite_store, "on-a") == {"open", "acknowledged"}
    with sqlite_store.session() as s:
        # a job on two devices: placed on a and on c, neither ended
        s.add(Placement(workflow_id="on-a", device_id=a, host_id="a", state="active", started_at=fleet.t0))
    detect(sqlite_store, now=fleet.minute(360), window_s=WINDOW, silent_limit_s=LIMIT)
    assert _statuses(sqlite_store, "on-a") == {"open", "acknowledged"}
    with sqlite_store.session() as s:
        # its placement on a ended while the one on c is still to start (a move under way): not moved yet
        s.execute(Placement.__table__.update().where(Placement.device_id == a).values(state="ended"))
        s.execute(Placement.__table__.update().where(Placement.device_id == c).values(state="pending"))
    detect(sqlite_store, now=fleet.minute(360), window_s=WINDOW, silent_limit_s=LIMIT)
    assert _statuses(sqlite_store, "on-a") == {"open", "acknowledged"}


def _processes_until_a_falls_silent(store) -> tuple[Fleet, int, int, int]:
    """The `_idle_on_a_busy_on_b` fleet with the processes agents record: on-a's on a (still running as far as the
    store knows: a's agent went down with it) and on-b's on b; a third host c."""
    fleet, a, b = _idle_on_a_busy_on_b(store)
    c = fleet.device(host="c")
    fleet.process("on-a", "a", 100, 0)
    fleet.process("on-b", "b", 100, 0)
    return fleet, a, b, c


def test_a_workflow_whose_process_started_on_another_host_after_the_silence_resolves_its_old_findings(any_store):
    fleet, a, b, c = _processes_until_a_falls_silent(any_store)
    fleet.process("on-a", "c", 300, 200)  # on-a runs on c from minute 200; a last reported at 179
    fleet.run(c, "on-a", 200, 360, util=0.95, mem_gib=70, pid=300)
    _b_busy_until(fleet, b, 180, 360)
    detect(any_store, now=fleet.minute(360), window_s=WINDOW, silent_limit_s=LIMIT)
    rows = _rows(any_store, "on-a")
    assert {dev for dev, _ in rows} == {a}
    assert {s for _, s, _ in rows.values()} == {"resolved"}
    assert {(e["resolution"]["reason"], e["resolution"]["now_on"], e["resolution"]["started"],
             e["resolution"]["last_report"]) for _, _, e in rows.values()} == {
        ("moved", "host c", fleet.minute(200), fleet.minute(179))}


def test_a_process_on_another_host_is_no_move_when_the_workflow_already_ran_there(sqlite_store):
    fleet, a, b, c = _processes_until_a_falls_silent(sqlite_store)
    # on-a also ran on c before a fell silent (one job on two hosts), and its process there was restarted since
    fleet.process("on-a", "c", 300, 60, ended_min=200)
    fleet.process("on-a", "c", 301, 200)
    # and a process of it on b that started before a's last report
    fleet.process("on-a", "b", 302, 150)
    _b_busy_until(fleet, b, 180, 360)
    detect(sqlite_store, now=fleet.minute(360), window_s=WINDOW, silent_limit_s=LIMIT)
    assert _statuses(sqlite_store, "on-a") == {"open", "acknowledged"}


def test_a_process_that_ended_on_another_host_is_no_move(sqlite_store):
    fleet, a, b, c = _processes_until_a_falls_silent(sqlite_store)
    fleet.process("on-a", "c", 300, 200, ended_min=230)  # it ran on c for a while and ended there
    _b_busy_until(fleet, b, 180, 360)
    detect(sqlite_store, now=fleet.minute(360), window_s=WINDOW, silent_limit_s=LIMIT)
    assert _statuses(sqlite_store, "on-a") == {"open", "acknowledged"}


def test_zombie_memory_on_a_silent_host_is_no_move_but_goes_with_the_limit(sqlite_store):
    fleet = Fleet(sqlite_store)
    a, b, c = fleet.device(host="a"), fleet.device(host="b"), fleet.device(host="c")
    fleet.workflow("gone")
    fleet.workflow("busy")
    fleet.process("gone", "a", 7, 0, ended_min=60)
    fleet.run(a, "gone", 0, 60, util=0.8, mem_gib=50, pid=7)
    fleet.run(a, None, 60, 180, util=0.0, mem_gib=50)
    fleet.run(b, "busy", 0, 180, util=0.95, mem_gib=70)
    fleet.flush()
    assert [f.rule for f in detect(sqlite_store, now=fleet.minute(180), window_s=WINDOW)] == ["zombie_memory"]
    with sqlite_store.session() as s:
        s.add(Placement(workflow_id="gone", device_id=a, host_id="a", state="ended", started_at=fleet.t0))
        s.add(Placement(workflow_id="gone", device_id=c, host_id="c", state="active", started_at=fleet.minute(200)))
    fleet.process("gone", "c", 8, 200)
    fleet.run(b, "busy", 180, 360, util=0.95, mem_gib=70)
    fleet.flush()
    detect(sqlite_store, now=fleet.minute(360), window_s=WINDOW, silent_limit_s=LIMIT)
    assert _statuses(sqlite_store, "gone") == {"open"}  # the memory it left on a may still be held
    fleet.run(b, "busy", 360, 960, util=0.95, mem_gib=70)
    fleet.flush()
    detect(sqlite_store, now=fleet.minute(960), window_s=WINDOW, silent_limit_s=LIMIT)
    assert _statuses(sqlite_store, "gone") == {"resolved"}
    assert [e["resolution"]["reason"] for _, _, e in _rows(sqlite_store, "gone").values()] == ["silent"]
