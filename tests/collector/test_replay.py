"""Replay: the Alibaba GenAI telemetry and fleetlens exports, bulk-loaded into a store and played live."""

from __future__ import annotations

import gzip
import logging
from pathlib import Path

import pytest
from sqlalchemy import func, select

from collector.recordings import load as load_module
from collector.recordings.alibaba import ALIBABA_DUTY_FILE, ALIBABA_MEMORY_FILE, ALIBABA_MEMORY_TOTAL
from collector.recordings.load import load_into_store
from collector.recordings.read import read_recording
from collector.sources.replay import ReplaySource
from store.errors import InvalidInput
from store.models import Device, DeviceSample, Host, Process, ProcessSample, Workflow
from store.registry import DeviceSpec, register_devices, register_host
from tests.conftest import FLEET

END = 2_000_000_000.0


def _count(store, model, *where) -> int:
    with store.session() as s:
        return s.scalar(select(func.count()).select_from(model).where(*where))


@pytest.mark.slow
def test_alibaba_whole_recording_loads_with_its_real_figures(any_store) -> None:
    summary = load_into_store(any_store, FLEET, end_at=END)
    # 143 containers with a duty-cycle series, 8 per virtual host; every (time, container) pair of either file
    assert (summary.workflows, summary.devices, summary.hosts) == (143, 143, 18)
    assert summary.device_samples == summary.process_samples == 161_414
    assert summary.skipped_rows == 1  # the one memory row of a container without a utilisation series
    assert summary.end == END and summary.start == pytest.approx(END - 22.8 * 3600, abs=1)
    assert _count(any_store, Workflow) == 143 and _count(any_store, Host, Host.source == "replay") == 18
    with any_store.session() as s:
        mean_util = s.scalar(select(func.avg(DeviceSample.gpu_util)))
        last_ts = s.scalar(select(func.max(DeviceSample.ts)))
        peak = s.scalar(select(func.max(ProcessSample.mem_used)))
        per_wf = dict(s.execute(select(ProcessSample.workflow_id, func.avg(ProcessSample.sm_util))
                                .group_by(ProcessSample.workflow_id)).all())
        totals = set(s.scalars(select(Device.memory_total)))
        missing_util = s.scalar(select(func.count()).where(DeviceSample.gpu_util.is_(None)))
    assert mean_util == pytest.approx(0.07025, abs=1e-4)  # PROVENANCE: mean utilisation 7 %
    assert last_ts == END
    assert peak == 50_833_129_472  # 47.3 GiB, the largest container
    assert sum(1 for v in per_wf.values() if v is not None and v < 0.10) == 123  # "123 of 143 average under 10 %"
    assert totals == {ALIBABA_MEMORY_TOTAL}
    # memory samples with no duty-cycle sample at that time are kept with utilisation missing, never 0
    assert missing_util == 161_414 - 157_417


def test_loading_again_replaces_instead_of_doubling(any_store) -> None:
    first = load_into_store(any_store, "alibaba", fleet_data_dir=FLEET, containers=5, end_at=END)
    again = load_into_store(any_store, "alibaba", fleet_data_dir=FLEET, containers=5, end_at=END + 600, speedup=2.0)
    assert first.device_samples == again.device_samples > 0
    assert _count(any_store, DeviceSample) == again.device_samples
    assert _count(any_store, ProcessSample) == again.process_samples
    assert _count(any_store, Process) == 5 and _count(any_store, Workflow) == 5
    with any_store.session() as s:
        lo, hi = s.execute(select(func.min(DeviceSample.ts), func.max(DeviceSample.ts))).one()
    assert hi == END + 600
    assert hi - lo == pytest.approx((first.end - first.start) / 2.0)  # speed-up 2 halves the span


def test_a_load_whose_samples_fail_leaves_the_earlier_samples(any_store, monkeypatch) -> None:
    """The earlier load's samples go in the transaction that writes the new ones: all of it or none."""
    first = load_into_store(any_store, "alibaba", fleet_data_dir=FLEET, containers=3, end_at=END)
    real_write = load_module.write_samples_on

    def write_then_fail(*args, **kwargs):
        real_write(*args, **kwargs)
        raise InvalidInput("refused half-way")

    monkeypatch.setattr(load_module, "write_samples_on", write_then_fail)
    with pytest.raises(InvalidInput, match="half-way"):
        load_into_store(any_store, "alibaba", fleet_data_dir=FLEET, containers=3, end_at=END + 600)
    assert _count(any_store, DeviceSample) == first.device_samples
    assert _count(any_store, ProcessSample) == first.process_samples
    with any_store.session() as s:
        assert s.scalar(select(func.max(DeviceSample.ts))) == END  # the first load's, not the failed one's


def test_appending_with_replace_off_keeps_both_loads(sqlite_store) -> None:
    first = load_into_store(sqlite_store, FLEET, containers=2, end_at=END)
    load_into_store(sqlite_store, FLEET, containers=2, end_at=END, replace=False)
    assert _count(sqlite_store, DeviceSample) == 2 * first.device_samples
    assert _count(sqlite_store, Process) == 2  # the same processes, not duplicated


def test_workflows_carry_team_and_state(sqlite_store) -> None:
    load_into_store(sqlite_store, FLEET, containers=16, end_at=END, teams=("a", "b"))
    with sqlite_store.session() as s:
        wfs = list(s.scalars(select(Workflow)))
        hosts = sorted(s.scalars(select(Host.id)))
    assert hosts == ["alibaba-h00", "alibaba-h01"]
    assert {w.team for w in wfs} <= {"a", "b"} and all(w.labels["team_source"] == "synthetic" for w in wfs)
    assert all(w.id.startswith("alibaba-") and w.id_source == "replay" for w in wfs)
    assert {w.state for w in wfs} <= {"running", "finished"}
    assert all(w.last_seen <= END for w in wfs)


def _alibaba_dir(tmp_path: Path, duty_lines: list[str], mem_lines: list[str]) -> Path:
    folder = tmp_path / "ali"
    folder.mkdir()
    with gzip.open(folder / ALIBABA_DUTY_FILE, "wt") as f:
        f.write("\n".join(duty_lines) + "\n")
    with gzip.open(folder / ALIBABA_MEMORY_FILE, "wt") as f:
        f.write("\n".join(mem_lines) + "\n")
    return folder


def test_malformed_rows_are_skipped_counted_and_the_rest_played(sqlite_store, tmp_path, caplog) -> None:
    folder = _alibaba_dir(
        tmp_path,
        [
            "value,timestamp_anon,container_ip",
            "10.0,1000.0,aaaaaaaaaaaaaaaa",
            "not-a-number,1057.0,aaaaaaaaaaaaaaaa",  # bad value
            "20.0,,aaaaaaaaaaaaaaaa",  # no time
            "30.0,1057.0,bbbbbbbbbbbbbbbb",
            "150.0,1114.0,bbbbbbbbbbbbbbbb",  # a duty cycle over 100 %
            "40.0,1114.0,aaaaaaaaaaaaaaaa,extra",  # a field too many
            "-1,1114.0,aaaaaaaaaaaaaaaa",  # negative
        ],
        ["timestamp_anon,value,container_ip", "1000.0,1073741824,aaaaaaaaaaaaaaaa", "1057.0,oops,bbbbbbbbbbbbbbbb"],
    )
    with caplog.at_level(logging.WARNING, logger="collector.recordings.read"):
        summary = load_into_store(sqlite_store, folder, end_at=END)
    assert summary.skipped_rows == 6
    assert "skipped 6 malformed rows" in caplog.text
    assert (summary.workflows, summary.device_samples) == (2, 2)
    with sqlite_store.session() as s:
        rows = s.execute(select(DeviceSample.gpu_util, DeviceSample.mem_used).order_by(DeviceSample.ts)).all()
    assert rows == [(0.10, 1073741824), (0.30, None)]


def test_missing_columns_name_expected_and_found(sqlite_store, tmp_path) -> None:
    folder = _alibaba_dir(tmp_path, ["util,time,container", "1,2,x"], ["timestamp_anon,value,container_ip"])
    with pytest.raises(InvalidInput) as err:
        load_into_store(sqlite_store, folder)
    text = str(err.value)
    assert "expected ['value', 'timestamp_anon', 'container_ip']" in text
    assert "found ['util', 'time', 'container']" in text
    assert _count(sqlite_store, Host) == 0  # nothing half-written


def test_a_device_clash_is_refused_with_what_to_do(sqlite_store) -> None:
    rec = read_recording(FLEET, containers=1)
    with sqlite_store.session() as s:
        register_host(s, "elsewhere", hostname="elsewhere", source="nvml")
        register_devices(s, "elsewhere", [DeviceSpec(0, rec.devices[0]["uuid"], "gpu", None)], source="nvml")
    with pytest.raises(InvalidInput, match="host_prefix"):
        load_into_store(sqlite_store, rec, end_at=END)
    assert load_into_store(sqlite_store, rec, end_at=END, host_prefix="r-").devices == 1


def test_unknown_path_is_refused(sqlite_store, tmp_path) -> None:
    with pytest.raises(InvalidInput, match="does not exist"):
        load_into_store(sqlite_store, tmp_path / "nope.jsonl.gz")
    with pytest.raises(InvalidInput, match="speedup"):
        load_into_store(sqlite_store, FLEET, speedup=0)


def test_replay_source_plays_at_the_chosen_speedup() -> None:
    rec = read_recording(FLEET, containers=16)
    clock = [1000.0]
    src = ReplaySource(rec, speedup=60.0, host="alibaba-h01", clock=lambda: clock[0])
    infos = src.devices()
    assert [d.index for d in infos] == list(range(8)) and all(d.memory_total == ALIBABA_MEMORY_TOTAL for d in infos)
    # never the uuid the same device has when bulk-loaded into the store
    assert all(d.uuid.startswith("live:replay-alibaba-") for d in infos)
    first = src.sample()
    assert len(first) == 8 and all(r.ts == 1000.0 for r in first)
    clock[0] += 3600 / 60.0  # one wall minute = one recorded hour
    assert src.position() == pytest.approx(rec.start + 3600)
    later = src.sample()
    # what the source plays is the recording's own row at that time
    dev = rec.device_samples
    row = dev[(dev.host_id == "alibaba-h01") & (dev.device_index == 3) & (dev.ts <= rec.start + 3600)].iloc[-1]
    reading = later[3]
    assert reading.gpu_util == pytest.approx(row.gpu_util) if row.gpu_util == row.gpu_util else reading.gpu_util is None
    assert len(reading.processes) == 1
    proc = reading.processes[0]
    assert proc.workflow_id.startswith("alibaba-") and proc.id_source == "replay"
    assert {w["id"] for w in src.workflows()} == {p.workflow_id for r in later for p in r.processes}


def test_replay_source_unknown_host_is_refused() -> None:
    rec = read_recording(FLEET, containers=8)
    with pytest.raises(InvalidInput, match="no host 'nowhere'"):
        ReplaySource(rec, host="nowhere")
