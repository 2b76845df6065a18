"""Each telemetry detector fires on samples built to trigger it, with the right numbers, and not on healthy ones."""

from __future__ import annotations

import pytest
from sqlalchemy import func, select

from analyzer.telemetry import RULES, detect, load_thresholds
from analyzer.telemetry.thresholds import DEFAULT_PATH
from store.errors import ConfigError, InvalidInput
from store.models import Finding
from tests.analyzer.telemetry_fleet import T0, Fleet

NOW = T0 + 180 * 60  # three hours of minute samples end here
WINDOW = 3 * 3600


def _by_rule(found):
    out: dict[str, list] = {}
    for f in found:
        out.setdefault(f.rule, []).append(f)
    return out


def _healthy(fleet: Fleet, wf: str = "healthy") -> int:
    dev = fleet.device()
    fleet.workflow(wf)
    fleet.run(dev, wf, 0, 180, util=0.92, mem_gib=70, sm_active=0.85)
    return dev


def test_healthy_workflow_gets_no_finding(any_store):
    fleet = Fleet(any_store)
    _healthy(fleet)
    fleet.flush()
    assert detect(any_store, now=NOW, window_s=WINDOW) == []


def test_idle_holder_fires_with_idle_hours_and_cost(sqlite_store):
    fleet = Fleet(sqlite_store)
    dev = fleet.device()
    fleet.workflow("idle")
    fleet.run(dev, "idle", 0, 60, util=0.9, mem_gib=40)
    fleet.run(dev, "idle", 60, 180, util=0.0, mem_gib=40)
    _healthy(fleet)
    fleet.flush()
    rules = _by_rule(detect(sqlite_store, now=NOW, window_s=WINDOW))
    assert set(rules) == {"idle_holder"}
    (f,) = rules["idle_holder"]
    assert f.workflow_id == "idle" and f.device_id == dev and f.source == "telemetry"
    assert f.evidence["idle_hours"] == pytest.approx(2.0)
    assert f.evidence["mem_held_gib"] == pytest.approx(40.0)
    assert f.gpu_hours_per_day == pytest.approx(16.0)  # 2 of 3 hours idle, at a daily rate
    assert f.severity == "high"
    assert "lane of 47 GiB" in f.fix and "fleetlens enforce" in f.fix  # 40 GiB x 1.155, rounded up
    assert "2023-11-14 23:00 to 2023-11-15 01:00 UTC" in f.location


def test_idle_holder_needs_30_minutes_and_held_memory(sqlite_store):
    fleet = Fleet(sqlite_store)
    short, empty = fleet.device(), fleet.device()
    fleet.workflow("short-pause")
    fleet.workflow("no-memory")
    # 25 idle minutes between busy stretches: below the 30-minute rule
    fleet.run(short, "short-pause", 0, 80, util=0.9, mem_gib=70)
    fleet.run(short, "short-pause", 80, 105, util=0.0, mem_gib=70)
    fleet.run(short, "short-pause", 105, 180, util=0.9, mem_gib=70)
    # idle for hours but holding almost nothing: not a holder
    fleet.run(empty, "no-memory", 0, 180, util=0.0, mem_gib=0.1, wf_mem_gib=0.1)
    fleet.flush()
    assert "idle_holder" not in _by_rule(detect(sqlite_store, now=NOW, window_s=WINDOW))


def test_low_utilization_fires_below_the_p95_threshold(sqlite_store):
    fleet = Fleet(sqlite_store)
    dev = fleet.device()
    fleet.workflow("low")
    fleet.run(dev, "low", 0, 180, util=0.2, mem_gib=60)
    _healthy(fleet)
    fleet.flush()
    rules = _by_rule(detect(sqlite_store, now=NOW, window_s=WINDOW))
    assert set(rules) == {"low_utilization"}
    (f,) = rules["low_utilization"]
    assert f.workflow_id == "low"
    assert f.evidence["util_p95"] == pytest.approx(0.2)
    # packed it would still need 75 % of the GPU (its memory), so a quarter of a GPU-day is recoverable
    assert f.evidence["share_needed"] == pytest.approx(0.75)
    assert f.gpu_hours_per_day == pytest.approx(6.0)


def test_misleading_utilization_needs_sm_activity(sqlite_store):
    fleet = Fleet(sqlite_store)
    lying, unknown, honest = fleet.device(), fleet.device(), fleet.device()
    for wf in ("lying", "unknown", "honest"):
        fleet.workflow(wf)
    fleet.run(lying, "lying", 0, 180, util=0.9, mem_gib=60, sm_active=0.1)
    fleet.run(unknown, "unknown", 0, 180, util=0.9, mem_gib=60, sm_active=None)
    fleet.run(honest, "honest", 0, 180, util=0.9, mem_gib=60, sm_active=0.8)
    fleet.flush()
    rules = _by_rule(detect(sqlite_store, now=NOW, window_s=WINDOW))
    assert set(rules) == {"misleading_utilization"}
    (f,) = rules["misleading_utilization"]
    assert f.workflow_id == "lying"
    assert f.evidence["util_mean"] == pytest.approx(0.9) and f.evidence["sm_active_mean"] == pytest.approx(0.1)
    assert f.gpu_hours_per_day == pytest.approx(24 * 0.8)


def test_memory_overprovisioned_names_the_lane(sqlite_store):
    fleet = Fleet(sqlite_store)
    small, big = fleet.device(), fleet.device()
    fleet.workflow("small")
    fleet.workflow("big")
    fleet.run(small, "small", 0, 180, util=0.9, mem_gib=10)  # 12.5 % of 80 GiB
    fleet.run(big, "big", 0, 180, util=0.9, mem_gib=30)  # 37.5 %: not over-provisioned
    fleet.flush()
    rules = _by_rule(detect(sqlite_store, now=NOW, window_s=WINDOW))
    assert set(rules) == {"memory_overprovisioned"}
    (f,) = rules["memory_overprovisioned"]
    assert f.workflow_id == "small"
    assert f.evidence["peak_fraction"] == pytest.approx(0.125)
    assert f.evidence["lane_gib"] == 12 and f.evidence["jobs_per_device"] == 6
    assert "move it to a lane of 12 GiB with `fleetlens enforce`" in f.fix
    # busy at 90 %, it keeps 90 % of the GPU's compute in the lane: 10 % of a GPU-day comes back
    assert f.gpu_hours_per_day == pytest.approx(2.4)


def test_zombie_memory_after_processes_ended(sqlite_store):
    fleet = Fleet(sqlite_store)
    gone, alive, freed = fleet.device(), fleet.device(), fleet.device()
    for wf in ("gone", "alive", "freed"):
        fleet.workflow(wf)
    # gone: its only process ended at minute 60, the device keeps 50 GiB for two more hours
    fleet.process("gone", "h1", 7, 0, ended_min=60)
    fleet.run(gone, "gone", 0, 60, util=0.8, mem_gib=50)
    fleet.run(gone, None, 60, 180, util=0.0, mem_gib=50)
    # alive: its process still runs (the collector just lost its per-process rows): not a zombie
    fleet.process("alive", "h1", 8, 0)
    fleet.run(alive, "alive", 0, 60, util=0.8, mem_gib=50, pid=8)
    fleet.run(alive, None, 60, 180, util=0.0, mem_gib=50)
    # freed: ended and the memory went back to the driver
    fleet.process("freed", "h1", 9, 0, ended_min=60)
    fleet.run(freed, "freed", 0, 60, util=0.8, mem_gib=50, pid=9)
    fleet.run(freed, None, 60, 180, util=0.0, mem_gib=0)
    fleet.flush()
    rules = _by_rule(detect(sqlite_store, now=NOW, window_s=WINDOW))
    assert [f.workflow_id for f in rules["zombie_memory"]] == ["gone"]
    (f,) = rules["zombie_memory"]
    assert f.device_id == gone
    assert f.evidence["zombie_hours"] == pytest.approx(2.0)
    assert f.evidence["mem_held_gib"] == pytest.approx(50.0)
    assert f.gpu_hours_per_day == pytest.approx(16.0)
    assert "host h1" in f.fix


def test_shared_device_splits_the_cost(sqlite_store):
    fleet = Fleet(sqlite_store)
    dev = fleet.device()
    fleet.workflow("a")
    fleet.workflow("b")
    fleet.run(dev, "a", 0, 180, util=0.0, mem_gib=40, wf_mem_gib=20, pid=1)
    fleet.run(dev, "b", 0, 180, util=0.0, mem_gib=40, wf_mem_gib=20, pid=2, device_rows=False)
    fleet.flush()
    idle = _by_rule(detect(sqlite_store, now=NOW, window_s=WINDOW))["idle_holder"]
    assert sorted(f.workflow_id for f in idle) == ["a", "b"]
    # each holds half of the device: 24 GPU-hours a day between them, not 48
    assert [f.gpu_hours_per_day for f in idle] == [pytest.approx(12.0)] * 2


def test_detect_is_idempotent_and_resolves_what_is_no_longer_true(any_store):
    fleet = Fleet(any_store)
    dev = fleet.device()
    fleet.workflow("idle")
    fleet.run(dev, "idle", 0, 180, util=0.0, mem_gib=70)
    fleet.flush()
    first = detect(any_store, now=NOW, window_s=WINDOW)
    again = detect(any_store, now=NOW, window_s=WINDOW)
    assert sorted((f.id, f.rule) for f in first) == sorted((f.id, f.rule) for f in again)
    with any_store.session() as s:
        assert s.scalar(select(func.count()).select_from(Finding)) == len(first)
    # the next three hours it works hard: the idle and low-utilisation findings resolve
    fleet.run(dev, "idle", 180, 360, util=0.95, mem_gib=70)
    fleet.flush()
    assert detect(any_store, now=T0 + 360 * 60, window_s=WINDOW) == []
    with any_store.session() as s:
        statuses = dict(s.execute(select(Finding.rule, Finding.status)).all())
    assert set(statuses) == {f.rule for f in first} and set(statuses.values()) == {"resolved"}


def test_a_window_without_any_sample_resolves_nothing(sqlite_store):
    fleet = Fleet(sqlite_store)
    dev = fleet.device()
    fleet.workflow("idle")
    fleet.run(dev, "idle", 0, 180, util=0.0, mem_gib=70)
    fleet.flush()
    first = detect(sqlite_store, now=NOW, window_s=WINDOW)
    assert first
    # the agents are down for the next three hours: nothing was measured, so nothing is judged resolved
    assert detect(sqlite_store, now=T0 + 360 * 60, window_s=WINDOW) == []
    with sqlite_store.session() as s:
        assert set(s.scalars(select(Finding.status))) == {"open"}


def test_window_bounds_what_is_read(sqlite_store):
    fleet = Fleet(sqlite_store)
    dev = fleet.device()
    fleet.workflow("earlier")
    fleet.run(dev, "earlier", 0, 120, util=0.0, mem_gib=70)
    fleet.run(dev, "earlier", 120, 240, util=0.95, mem_gib=70)
    fleet.flush()
    assert detect(sqlite_store, now=T0 + 240 * 60, window_s=7200) == []  # only the busy two hours
    assert {f.rule for f in detect(sqlite_store, now=T0 + 240 * 60, window_s=4 * 3600)} >= {"idle_holder"}


def test_samples_of_unregistered_workflows_are_skipped(sqlite_store):
    fleet = Fleet(sqlite_store)
    dev = fleet.device()
    fleet.run(dev, "never-registered", 0, 180, util=0.0, mem_gib=70)
    fleet.flush()
    assert detect(sqlite_store, now=NOW, window_s=WINDOW) == []


def test_empty_store_and_bad_window(sqlite_store):
    assert detect(sqlite_store, now=NOW) == []
    with pytest.raises(InvalidInput, match="window"):
        detect(sqlite_store, now=NOW, window_s=-5)


def test_thresholds_file_errors_name_the_file(tmp_path):
    th = load_thresholds()
    assert th.idle_holder.min_duration_s == 1800 and th.memory_overprovisioned.peak_fraction_max == 0.25
    bad = tmp_path / "t.toml"
    bad.write_text("[common\n")
    with pytest.raises(ConfigError, match=str(bad)):
        load_thresholds(bad)
    th_text = DEFAULT_PATH.read_text()
    bad.write_text(th_text.replace("[zombie_memory]", "[zombie]"))
    with pytest.raises(ConfigError, match=r"\[zombie_memory\] is missing"):
        load_thresholds(bad)
    bad.write_text(th_text.replace("util_max = 0.05", 'util_max = "low"'))
    with pytest.raises(ConfigError, match="util_max"):
        load_thresholds(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        load_thresholds(tmp_path / "missing.toml")


def test_stricter_thresholds_change_the_outcome(sqlite_store, tmp_path):
    fleet = Fleet(sqlite_store)
    dev = fleet.device()
    fleet.workflow("low")
    fleet.run(dev, "low", 0, 180, util=0.2, mem_gib=60)
    fleet.flush()
    strict = tmp_path / "strict.toml"
    strict.write_text(DEFAULT_PATH.read_text().replace("util_p95_max = 0.30", "util_p95_max = 0.10"))
    assert detect(sqlite_store, now=NOW, window_s=WINDOW, thresholds=load_thresholds(strict)) == []
    assert {f.rule for f in detect(sqlite_store, now=NOW, window_s=WINDOW)} == {"low_utilization"}
    assert set(RULES) == {"idle_holder", "low_utilization", "misleading_utilization", "memory_overprovisioned",
                          "zombie_memory"}


@pytest.mark.parametrize(("source", "name", "said", "not_said"), [
    # NVML and DCGM (imported from Prometheus) report NVIDIA GPUs: CUDA graphs and nvidia-smi apply
    ("nvml", "NVIDIA A100-SXM4-80GB", ["capture CUDA graphs", "`nvidia-smi --query-compute-apps", "reset the GPU",
                                       "release the GPU while idle", "fewer GPUs"], []),
    ("prometheus", "NVIDIA H100 80GB HBM3", ["capture CUDA graphs", "`nvidia-smi"], []),
    # the cpu source's groups of cores: no kernels, no CUDA, no GPU
    ("cpu", "cpu cores 0-3", ["keep the cores busy", "`ps -eo pid,rss,psr,cmd`", "release the CPU device while idle",
                              "fewer CPU devices"],
     ["CUDA", "nvidia-smi", "GPU", "kernel"]),
    # a replayed device whose name names no vendor: no vendor's tools either
    ("replay", "Instinct MI250X", ["where the device's runtime offers graphs", "reset the device",
                                   "release the device while idle"],
     ["CUDA", "nvidia-smi", "GPU"]),
])
def test_device_advice_is_in_the_words_of_the_devices_source(sqlite_store, source, name, said, not_said):
    fleet = Fleet(sqlite_store)
    busy, held, idle = (fleet.device("h9", name=name, source=source) for _ in range(3))
    for wf in ("tiny", "gone", "idle"):
        fleet.workflow(wf)
    fleet.run(idle, "idle", 0, 180, util=0.0, mem_gib=40, sm_active=0.0)
    fleet.run(busy, "tiny", 0, 180, util=0.9, mem_gib=60, sm_active=0.1)
    fleet.process("gone", "h9", 7, 0, ended_min=60)
    fleet.run(held, "gone", 0, 60, util=0.8, mem_gib=50, sm_active=0.8)
    fleet.run(held, None, 60, 180, util=0.0, mem_gib=50)
    fleet.flush()
    rules = _by_rule(detect(sqlite_store, now=NOW, window_s=WINDOW))
    (misleading,) = rules["misleading_utilization"]
    (zombie,) = rules["zombie_memory"]
    (holder,) = rules["idle_holder"]
    (low,) = rules["low_utilization"]
    text = " ".join(f.fix for f in (misleading, zombie, holder, low))
    for words in said:
        assert words in text
    for words in not_said:
        assert words not in text
