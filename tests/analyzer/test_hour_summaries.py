"""Judging a window from the hours the rollup kept finds what judging its samples finds: runs that cross hours are
joined, a pair's p95 over several hours is its p95, orphaned memory is blamed on the workflow seen hours before; and
the kept hours are what is read (the samples can be gone), only under the thresholds that made them."""

from __future__ import annotations

import pytest
from sqlalchemy import delete, func, select, update

from analyzer.rollups import rollup
from analyzer.telemetry import detect, load_window
from analyzer.telemetry.hour_summaries import kept_hours, thresholds_key, uncovered
from analyzer.telemetry.summary import Piece, combine, summarise
from analyzer.telemetry.thresholds import load_thresholds, scaled
from store.models import DeviceSample, ProcessSample, TelemetryHour
from tests.analyzer.telemetry_fleet import T0, Fleet

HOURS = 4
NOW = T0 + HOURS * 3600


def crossing_fleet(store) -> dict[str, int]:
    """Idle runs, orphaned memory and utilisation whose every finding needs more than one hour."""
    fleet = Fleet(store)
    devs: dict[str, int] = {}

    def add(wf: str, host: str = "h1") -> int:
        fleet.workflow(wf)
        devs[wf] = fleet.device(host)
        return devs[wf]

    d = add("idler")  # idle 100 minutes across two hour boundaries: 20 + 60 + 20 minutes of three hours
    fleet.run(d, "idler", 0, 40, util=0.7, mem_gib=20)
    fleet.run(d, "idler", 40, 140, util=0.0, mem_gib=20)
    fleet.run(d, "idler", 140, 240, util=0.6, mem_gib=20)
    d = add("lowly", "h2")  # whole percents that differ minute by minute: p95 24 % over the four hours
    for m in range(240):
        fleet.run(d, "lowly", m, m + 1, util=((m * 7) % 25) / 100, mem_gib=30)
    d = add("lying", "h2")
    fleet.run(d, "lying", 0, 240, util=0.9, mem_gib=60, sm_active=0.1)
    d = add("ghost", "h3")  # its process ends with the first hour; its memory stays, with nobody on the device
    fleet.process("ghost", "h3", 7, 0, ended_min=60)
    fleet.run(d, "ghost", 0, 60, util=0.8, mem_gib=50, pid=7)
    fleet.run(d, None, 60, 200, util=0.0, mem_gib=50)
    d = add("share-a", "h4")  # two workflows idle on one device: each costs half
    fleet.workflow("share-b")
    fleet.run(d, "share-a", 0, 240, util=0.0, mem_gib=40, wf_mem_gib=20, pid=1)
    fleet.run(d, "share-b", 0, 240, util=0.0, mem_gib=40, wf_mem_gib=20, pid=2, device_rows=False)
    d = add("healthy", "h4")
    fleet.run(d, "healthy", 0, 240, util=0.92, mem_gib=70, sm_active=0.85)
    fleet.flush()
    return devs


def described(found) -> set[tuple]:
    return {(f.rule, f.workflow_id, f.device_id, f.severity, round(f.gpu_hours_per_day, 6), f.title,
             tuple(sorted((k, round(v, 6) if isinstance(v, float) else str(v)) for k, v in f.evidence.items())))
            for f in found}


def test_kept_hours_find_what_the_samples_find_even_once_the_samples_are_gone(any_store) -> None:
    crossing_fleet(any_store)
    from_samples = described(detect(any_store, now=NOW, window_s=HOURS * 3600))
    rules = {(rule, wf) for rule, wf, *_ in from_samples}
    assert {("idle_holder", "idler"), ("low_utilization", "lowly"), ("misleading_utilization", "lying"),
            ("zombie_memory", "ghost"), ("idle_holder", "share-a"), ("idle_holder", "share-b")} <= rules
    idle = next(x for x in from_samples if x[:2] == ("idle_holder", "idler"))
    assert dict(idle[6])["idle_hours"] == pytest.approx(100 / 60, abs=1e-3)  # one run over three hours

    rollup(any_store, NOW, since=T0)
    assert len(kept_hours(any_store, T0, NOW, load_thresholds())) == HOURS
    assert described(detect(any_store, now=NOW, window_s=HOURS * 3600)) == from_samples

    with any_store.session() as session:  # judged from the kept hours alone
        session.execute(delete(DeviceSample))
        session.execute(delete(ProcessSample))
    assert described(detect(any_store, now=NOW, window_s=HOURS * 3600)) == from_samples


def test_a_window_across_kept_and_open_hours_reads_the_rest_from_samples(sqlite_store) -> None:
    crossing_fleet(sqlite_store)
    th = load_thresholds()
    start, end = T0 + 30 * 60, T0 + 230 * 60
    from_samples = described(detect(sqlite_store, now=end, window_s=end - start))
    rollup(sqlite_store, T0 + 3 * 3600, since=T0)  # hours 0-2 kept; the fourth is still open
    kept = kept_hours(sqlite_store, start, end, th)
    assert [p.start for p in kept] == [T0 + 3600, T0 + 7200]  # whole hours inside the window only
    assert uncovered(start, end, kept) == [(start, T0 + 3600), (T0 + 3 * 3600, end)]
    assert described(detect(sqlite_store, now=end, window_s=end - start)) == from_samples


def test_a_kept_hour_that_cannot_be_read_is_judged_from_its_samples(sqlite_store, caplog) -> None:
    crossing_fleet(sqlite_store)
    from_samples = described(detect(sqlite_store, now=NOW, window_s=HOURS * 3600))
    rollup(sqlite_store, NOW, since=T0)
    with sqlite_store.session() as session:
        session.execute(update(TelemetryHour).where(TelemetryHour.hour == T0 + 3600).values(runs=b"not arrow"))
    assert [p.start for p in kept_hours(sqlite_store, T0, NOW, load_thresholds())] == [T0, T0 + 7200, T0 + 10800]
    assert "cannot be read" in caplog.text
    assert described(detect(sqlite_store, now=NOW, window_s=HOURS * 3600)) == from_samples


def test_hours_kept_under_other_thresholds_are_not_used(sqlite_store) -> None:
    crossing_fleet(sqlite_store)
    rollup(sqlite_store, NOW, since=T0)
    demo_time = scaled(load_thresholds(), 0.1)
    assert thresholds_key(demo_time) != thresholds_key(load_thresholds())
    assert kept_hours(sqlite_store, T0, NOW, demo_time) == []
    found = described(detect(sqlite_store, now=NOW, window_s=HOURS * 3600, thresholds=demo_time))
    assert ("zombie_memory", "ghost") in {x[:2] for x in found}


def test_rolling_an_hour_up_again_replaces_its_summary(sqlite_store) -> None:
    devs = crossing_fleet(sqlite_store)
    rollup(sqlite_store, NOW, since=T0)
    fleet = Fleet(sqlite_store)
    fleet.hosts[devs["healthy"]] = "h4"
    fleet.run(devs["healthy"], "healthy", 240, 241, util=0.9, mem_gib=70)  # a late sample of the hour before NOW
    fleet.device_rows[0]["ts"] = NOW - 30
    fleet.process_rows[0]["ts"] = NOW - 30
    fleet.flush()
    rollup(sqlite_store, NOW, since=T0)
    with sqlite_store.session() as session:
        assert session.scalar(select(func.count()).select_from(TelemetryHour)) == HOURS
    (last,) = kept_hours(sqlite_store, NOW - 3600, NOW, load_thresholds())
    healthy = last.pairs[last.pairs["workflow_id"] == "healthy"]
    assert float(healthy["seen_last_ts"].iloc[0]) == NOW - 30


def test_a_p95_over_several_pieces_is_read_from_bins_rounded_up(sqlite_store) -> None:
    """Utilisation that is not a whole number of bins is read as its bin's upper edge: never lower than the truth,
    so the waste it implies is never overstated."""
    fleet = Fleet(sqlite_store)
    fleet.workflow("w")
    d = fleet.device()
    fleet.run(d, "w", 0, 120, util=0.2345, mem_gib=30)
    fleet.flush()
    th = load_thresholds()
    window = load_window(sqlite_store, T0, T0 + 7200, th.common)
    whole = combine([summarise(window, th)], th, start=T0, end=T0 + 7200, devices=window.devices,
                    workflows=window.workflows)
    halves = [summarise(window, th, T0, T0 + 3600), summarise(window, th, T0 + 3600, T0 + 7200)]
    assert all(isinstance(p, Piece) for p in halves)
    split = combine(halves, th, start=T0, end=T0 + 7200, devices=window.devices, workflows=window.workflows)
    assert float(whole.stats.loc[("w", d), "util_p95"]) == pytest.approx(0.2345)
    assert float(split.stats.loc[("w", d), "util_p95"]) == pytest.approx(0.235)
    assert float(split.stats.loc[("w", d), "util_mean"]) == pytest.approx(0.2345)
    assert float(split.stats.loc[("w", d), "held_s"]) == pytest.approx(float(whole.stats.loc[("w", d), "held_s"]))
