"""The detectors on the real Alibaba GenAI telemetry (143 serving containers, 22.8 h): pinned counts and GPU-hours.

The recording is loaded with collector.recordings.load.load_into_store (one workflow alone on its own
80 GiB virtual GPU per container), unshifted, and the detectors look at the whole day.
"""

from __future__ import annotations

from collections import Counter

import pytest
from sqlalchemy import func, select

from analyzer.ranking import findings_frame, rank_with_waste
from analyzer.rollups import rollup
from analyzer.telemetry import detect
from collector.recordings.load import load_into_store
from store.db import Store
from store.migrations import upgrade
from store.models import DeviceSample, Rollup
from tests.conftest import FLEET

RECORDED_END = 1662940800.0
NOW = RECORDED_END + 60
DAY = 86400.0

# what the detectors find (checked against the provenance's facts in test_the_recording_is_what_provenance_says)
FLAGGED = {"idle_holder": 126, "low_utilization": 107, "memory_overprovisioned": 7}
FLAGGED_CONTAINERS = 127
GPU_HOURS_PER_DAY = {"idle_holder": 801.46, "low_utilization": 1125.53, "memory_overprovisioned": 56.2}
# by the one waste function: overlapping claims on a container's device united, bounded by what it held
RECOVERABLE_GPU_HOURS_PER_DAY = 1532.16
HELD_GPU_HOURS_PER_DAY = 2658.98


def _summary(store: Store) -> dict:
    found = detect(store, now=NOW, window_s=DAY)
    assert detect(store, now=NOW, window_s=DAY)  # a second run updates the same findings
    by_rule = Counter(f.rule for f in found)
    per_rule = {r: round(sum(f.gpu_hours_per_day for f in found if f.rule == r), 2) for r in by_rule}
    rollup(store, now=NOW)
    ranked, w = rank_with_waste(store, now=NOW)
    frame = findings_frame(store)
    claimed = frame.groupby(["workflow_id", "device_id"])["gpu_hours_per_day"].sum()
    held = dict(zip(ranked["workflow_id"], ranked["held_gpu_hours_per_day"], strict=True))
    recoverable = ranked.set_index("workflow_id")["recoverable_gpu_hours_per_day"]
    top = claimed.idxmax()[0]
    return {
        "held": round(w.held_gpu_hours_per_day, 2),
        # the findings' own claims on one device add up past a day (59.6 GPU-h on one container) ...
        "claimed_max": round(float(claimed.max()), 1),
        # ... the recoverable figure never passes what was held, per workflow and per device
        "over_held": int((ranked["recoverable_gpu_hours_per_day"] > ranked["held_gpu_hours_per_day"] + 1e-9).sum()),
        "device_over_held": int((w.devices["recoverable_gpu_hours_per_day"]
                                 > w.devices["held_gpu_hours_per_day"] + 1e-9).sum()),
        "top": (top, round(float(recoverable[top]), 2), round(held[top], 2)),
        "flagged": dict(by_rule),
        "containers": len({f.workflow_id for f in found}),
        "gpu_hours": per_rule,
        "recoverable": round(float(ranked["recoverable_gpu_hours_per_day"].sum()), 2),
        "one_per_workflow_and_rule": len(found) == len({(f.rule, f.workflow_id) for f in found}),
        "open_in_store": len(findings_frame(store)),
    }


@pytest.fixture(scope="module")
def alibaba_sqlite(tmp_path_factory) -> Store:
    store = Store(f"sqlite:///{tmp_path_factory.mktemp('alibaba') / 'fleetlens.db'}")
    upgrade(store)
    loaded = load_into_store(store, FLEET, end_at=RECORDED_END)
    assert (loaded.devices, loaded.workflows) == (143, 143)
    yield store
    store.dispose()


def _check(summary: dict) -> None:
    assert summary["flagged"] == FLAGGED
    assert summary["containers"] == FLAGGED_CONTAINERS
    assert summary["gpu_hours"] == pytest.approx(GPU_HOURS_PER_DAY, abs=0.05)
    assert summary["recoverable"] == pytest.approx(RECOVERABLE_GPU_HOURS_PER_DAY, abs=0.05)
    assert summary["held"] == pytest.approx(HELD_GPU_HOURS_PER_DAY, abs=0.05)
    assert summary["claimed_max"] == pytest.approx(59.6, abs=0.05)
    assert summary["over_held"] == 0 and summary["device_over_held"] == 0
    wf, recoverable, held = summary["top"]
    assert wf == "alibaba-673d36875994" and held == pytest.approx(23.77, abs=0.01)
    assert 23.9 * held / 24 <= recoverable <= held  # at least its idle share, at most what it held
    assert summary["one_per_workflow_and_rule"]
    assert summary["open_in_store"] == sum(FLAGGED.values())  # no duplicates after two runs


@pytest.mark.slow
def test_alibaba_counts_on_sqlite(alibaba_sqlite):
    # misleading_utilization and zombie_memory find nothing: the recording has no SM activity, and no
    # container's memory outlives its process
    _check(_summary(alibaba_sqlite))


@pytest.mark.slow
def test_the_recording_is_what_provenance_says(alibaba_sqlite):
    """Mean utilisation 7 %; 123 of 143 containers average under 10 %; peak memory median 37 GiB."""
    store = alibaba_sqlite
    with store.session() as s:
        assert s.scalar(select(func.avg(DeviceSample.gpu_util))) == pytest.approx(0.0703, abs=0.0005)
        per_device = s.execute(
            select(func.avg(DeviceSample.gpu_util), func.max(DeviceSample.mem_used)).group_by(DeviceSample.device_id)
        ).all()
    assert len(per_device) == 143
    assert sum(1 for mean, _ in per_device if mean is not None and mean < 0.10) == 123
    peaks = sorted(peak / (1 << 30) for _, peak in per_device if peak is not None)
    assert peaks[len(peaks) // 2] == pytest.approx(37.0, abs=0.3)
    # the hourly rollups agree: 143 devices, the fleet held ~2,200 GPU-hours and used ~7 % of them
    rollup(store, now=NOW + 3600)
    with store.session() as s:
        held, active, devices = s.execute(
            select(func.sum(Rollup.gpu_hours_held), func.sum(Rollup.gpu_hours_active),
                   func.count(func.distinct(Rollup.subject))).where(Rollup.scope == "device")
        ).one()
    assert devices == 143
    assert active / held == pytest.approx(0.07, abs=0.01)


@pytest.mark.pg
@pytest.mark.slow
def test_alibaba_counts_on_postgres(pg_store):
    load_into_store(pg_store, FLEET, end_at=RECORDED_END)
    _check(_summary(pg_store))
