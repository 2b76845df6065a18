"""Judging part of the fleet on compressed time: scaled thresholds, and detection scoped to some workflows."""

from __future__ import annotations

import pytest

from analyzer.telemetry import detect
from analyzer.telemetry.thresholds import load_thresholds, scaled
from store.errors import InvalidInput
from store.findings import open_findings
from tests.analyzer.telemetry_fleet import Fleet

NOW_MIN = 180


def test_scaled_multiplies_every_duration_and_nothing_else():
    base = load_thresholds()
    fast = scaled(base, 1 / 60)
    assert fast.idle_holder.min_duration_s == pytest.approx(base.idle_holder.min_duration_s / 60)
    assert fast.low_utilization.min_held_s == pytest.approx(base.low_utilization.min_held_s / 60)
    assert fast.idle_holder.util_max == base.idle_holder.util_max
    assert fast.memory_overprovisioned.peak_fraction_max == base.memory_overprovisioned.peak_fraction_max
    with pytest.raises(InvalidInput):
        scaled(base, 0)


def test_scoped_detection_records_and_resolves_only_its_workflows(sqlite_store):
    fleet = Fleet(sqlite_store)
    old_dev, new_dev = fleet.device(), fleet.device()
    fleet.workflow("old-idle")
    fleet.workflow("young-idle")
    fleet.run(old_dev, "old-idle", 0, NOW_MIN, util=0.0, mem_gib=40)  # idle for 3 hours
    fleet.run(new_dev, "young-idle", NOW_MIN - 5, NOW_MIN, util=0.0, mem_gib=40, pid=200)  # idle for 5 minutes
    fleet.flush()
    now = fleet.minute(NOW_MIN)

    detect(sqlite_store, now=now, window_s=4 * 3600)
    with sqlite_store.session() as s:
        assert {f.workflow_id for f in open_findings(s, rules=("idle_holder",))} == {"old-idle"}

    # On time sped up 60x, five idle minutes are five idle hours: the young job is a holder too, and the old
    # job's finding, outside the scope, is neither re-judged nor resolved.
    detect(sqlite_store, now=now, window_s=600, thresholds=scaled(load_thresholds(), 1 / 60), workflows=["young-idle"])
    with sqlite_store.session() as s:
        assert {f.workflow_id for f in open_findings(s, rules=("idle_holder",))} == {"old-idle", "young-idle"}


def test_a_workflow_is_judged_on_its_own_utilisation_on_a_shared_device(sqlite_store):
    """The cpu source records each process's share of the device: an idle job beside a busy one is idle."""
    fleet = Fleet(sqlite_store)
    dev = fleet.device(host="shared")
    fleet.workflow("busy")
    fleet.workflow("sleeper")
    fleet.run(dev, "busy", 0, NOW_MIN, util=0.95, mem_gib=10)  # the device is busy all the time
    fleet.run(dev, "sleeper", 0, NOW_MIN, util=0.95, mem_gib=10, pid=300, device_rows=False)
    for row in fleet.process_rows:
        row["cpu_util"] = 0.9 if row["workflow_id"] == "busy" else 0.01
    fleet.flush()
    found = detect(sqlite_store, now=fleet.minute(NOW_MIN), window_s=4 * 3600)
    idle = {f.workflow_id for f in found if f.rule == "idle_holder"}
    assert idle == {"sleeper"}
