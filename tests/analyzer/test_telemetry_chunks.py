"""Detection a group of devices at a time judges the fleet exactly as reading it whole: groups keep each workflow's
devices together, and every rule finds the same workflows with the same numbers."""

from __future__ import annotations

import pytest

from analyzer.telemetry import detect
from analyzer.telemetry.chunks import device_chunks
from analyzer.telemetry.frame import load_window
from analyzer.telemetry.thresholds import load_thresholds
from tests.analyzer.telemetry_fleet import T0, Fleet

NOW = T0 + 180 * 60
WINDOW = 3 * 3600


def mixed_fleet(store) -> dict[str, list[int]]:
    """One workflow of each kind, one spread over two hosts, two sharing a device, one healthy."""
    fleet = Fleet(store)
    devs: dict[str, list[int]] = {}

    def add(wf: str, host: str = "h1", n: int = 1) -> list[int]:
        fleet.workflow(wf, gpus=n)
        devs[wf] = [fleet.device(host) for _ in range(n)]
        return devs[wf]

    (d,) = add("idle")
    fleet.run(d, "idle", 0, 60, util=0.9, mem_gib=40)
    fleet.run(d, "idle", 60, 180, util=0.0, mem_gib=40)
    (d,) = add("low", "h2")
    fleet.run(d, "low", 0, 180, util=0.15, mem_gib=60, sm_active=0.1)
    (d,) = add("lying", "h2")
    fleet.run(d, "lying", 0, 180, util=0.9, mem_gib=60, sm_active=0.1)
    (d,) = add("small", "h3")
    fleet.run(d, "small", 0, 180, util=0.9, mem_gib=10, sm_active=0.85)
    a, b = add("spread", "h3", 1) + add("spread-2", "h4", 1)
    fleet.workflow("spread")
    devs["spread"] = [a, b]
    fleet.run(a, "spread", 0, 180, util=0.0, mem_gib=50, pid=11)
    fleet.run(b, "spread", 0, 180, util=0.0, mem_gib=50, pid=12)
    (d,) = add("share-a", "h4")
    fleet.workflow("share-b")
    fleet.run(d, "share-a", 0, 180, util=0.0, mem_gib=40, wf_mem_gib=20, pid=1)
    fleet.run(d, "share-b", 0, 180, util=0.0, mem_gib=40, wf_mem_gib=20, pid=2, device_rows=False)
    (d,) = add("gone", "h5")
    fleet.process("gone", "h5", 7, 0, ended_min=60)
    fleet.run(d, "gone", 0, 60, util=0.8, mem_gib=50, pid=7)
    fleet.run(d, None, 60, 180, util=0.0, mem_gib=50)
    (d,) = add("healthy", "h5")
    fleet.run(d, "healthy", 0, 180, util=0.92, mem_gib=70, sm_active=0.85)
    fleet.flush()
    return devs


def summary(found) -> set[tuple]:
    return {(f.rule, f.workflow_id, f.device_id, f.severity, round(f.gpu_hours_per_day, 6),
             tuple(sorted((k, round(v, 6) if isinstance(v, float) else str(v)) for k, v in f.evidence.items())))
            for f in found}


def test_groups_keep_a_workflows_devices_together(any_store) -> None:
    devs = mixed_fleet(any_store)
    chunks = device_chunks(any_store, NOW - WINDOW, NOW, 1)
    where = {d: i for i, chunk in enumerate(chunks) for d in chunk}
    assert where[devs["spread"][0]] == where[devs["spread"][1]]  # a two-device workflow is never split
    assert sorted(d for c in chunks for d in c) == sorted({d for ds in devs.values() for d in ds})
    assert all(len(c) == 1 for c in chunks if devs["spread"][0] not in c)
    assert len(device_chunks(any_store, NOW - WINDOW, NOW, 1000)) == 1
    window = load_window(any_store, NOW - WINDOW, NOW, load_thresholds().common, devs["idle"])
    assert set(window.samples["device_id"]) == set(devs["idle"]) and not window.samples.empty


def test_detection_in_groups_finds_what_the_whole_fleet_read_at_once_finds(any_store) -> None:
    mixed_fleet(any_store)
    whole = summary(detect(any_store, now=NOW, window_s=WINDOW, chunk_devices=0))
    assert {r for r, *_ in whole} >= {"idle_holder", "low_utilization", "misleading_utilization",
                                       "memory_overprovisioned", "zombie_memory"}
    assert {wf for _, wf, *_ in whole} >= {"spread", "share-a", "share-b"}
    for size in (1, 2, 3):
        assert summary(detect(any_store, now=NOW, window_s=WINDOW, chunk_devices=size)) == whole, size


@pytest.mark.parametrize("size", [0, 1])
def test_an_empty_store_has_nothing_to_judge(sqlite_store, size) -> None:
    assert detect(sqlite_store, now=NOW, window_s=WINDOW, chunk_devices=size) == []
