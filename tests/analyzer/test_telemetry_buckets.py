"""Samples faster than one per bucket are averaged in the database: the detectors and rollups see 60 s buckets of
5 s samples, and judge them as they judge the samples themselves (SQLite and PostgreSQL)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from analyzer.rollups import device_rollups, workflow_rollups
from analyzer.telemetry import find_all, load_thresholds, load_window
from tests.analyzer.telemetry_fleet import GIB, T0, Fleet

STEPS = 2 * 720  # two hours of 5 s samples


@pytest.fixture
def fast_fleet(any_store):
    fleet = Fleet(any_store, interval_s=5.0)
    idle_dev, busy_dev = fleet.device(), fleet.device()
    fleet.workflow("idle", team="a")
    fleet.workflow("busy", team="b")
    fleet.run(idle_dev, "idle", 0, STEPS, util=0.0, mem_gib=20.0)
    for step in range(STEPS):  # utilisation alternates 0.9 / 0.5: a minute's mean is 0.7
        fleet.run(busy_dev, "busy", step, step + 1, util=0.9 if step % 2 else 0.5, mem_gib=30.0, wf_mem_gib=12.0,
                  pid=200)
    fleet.run(busy_dev, "busy", 0, STEPS, util=0.0, mem_gib=30.0, wf_mem_gib=8.0, pid=201, device_rows=False)
    fleet.flush()
    return any_store, idle_dev, busy_dev


def _thresholds(bucket_s: float):
    th = load_thresholds()
    return replace(th, common=replace(th.common, bucket_s=bucket_s))


def test_fast_samples_are_read_as_minute_buckets(fast_fleet):
    store, idle_dev, busy_dev = fast_fleet
    end = T0 + STEPS * 5.0
    window = load_window(store, T0, end, _thresholds(60.0).common)
    assert len(window.samples) == 2 * STEPS // 12  # one row per device and minute, not per sample
    assert window.samples["n_raw"].sum() == 2 * STEPS
    assert window.samples["dt"].median() == pytest.approx(60.0)
    busy = window.usage[window.usage.workflow_id == "busy"]
    assert len(busy) == STEPS // 12
    assert busy["gpu_util"].to_numpy() == pytest.approx(0.7)  # the bucket's mean
    # a workflow's memory on a device: exact for one process; for several, the largest's peak times their number,
    # an upper bound of their sum (12 + 8 GiB here)
    idle = window.usage[window.usage.workflow_id == "idle"]
    assert idle["wf_mem"].to_numpy() == pytest.approx(20.0 * GIB)
    assert busy["wf_mem"].to_numpy() == pytest.approx(2 * 12.0 * GIB)
    per_bucket = window.processes.groupby("workflow_id")["n_raw"].unique()
    assert list(per_bucket["busy"]) == [24.0] and list(per_bucket["idle"]) == [12.0]  # 12 samples x its processes


def test_buckets_find_what_every_sample_finds_and_roll_up_the_same_hours(fast_fleet):
    store, idle_dev, busy_dev = fast_fleet
    end = T0 + STEPS * 5.0
    bucketed, raw = _thresholds(60.0), _thresholds(0.0)
    wb, wr = load_window(store, T0, end, bucketed.common), load_window(store, T0, end, raw.common)
    assert len(wr.samples) == 2 * STEPS  # bucket_s = 0: every sample

    def found(window, th):
        return {(s.rule, s.workflow_id): s for s in find_all(window, th)}

    fb, fr = found(wb, bucketed), found(wr, raw)
    assert set(fb) == set(fr) and ("idle_holder", "idle") in fb
    assert fb[("idle_holder", "idle")].gpu_hours_per_day == pytest.approx(fr[("idle_holder", "idle")].gpu_hours_per_day)
    assert not any(wf == "busy" for _, wf in fb)

    for rollups in (device_rollups, workflow_rollups):
        rb = {(r["subject"], r["hour"]): r for r in rollups(wb, 0.0)}
        rr = {(r["subject"], r["hour"]): r for r in rollups(wr, 0.0)}
        assert rb.keys() == rr.keys() and len(rb) == 4  # 2 subjects x 2 hours
        for key, r in rb.items():
            assert r["samples"] == rr[key]["samples"]  # raw samples counted, not buckets
            assert r["gpu_hours_held"] == pytest.approx(rr[key]["gpu_hours_held"])
            assert r["gpu_hours_active"] == pytest.approx(rr[key]["gpu_hours_active"])
            assert r["util_mean"] == pytest.approx(rr[key]["util_mean"])
            if key[0] == "busy":  # two processes on one device: the bound, never below their true sum
                assert r["mem_peak"] == 24 * GIB and rr[key]["mem_peak"] == 20 * GIB
            else:
                assert r["mem_peak"] == rr[key]["mem_peak"]
