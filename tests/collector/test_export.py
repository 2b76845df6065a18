"""fleetlens's export format: written from a store, read back by replay (bulk and live), bad files refused."""

from __future__ import annotations

import gzip
import json
import logging
from pathlib import Path

import pytest
from sqlalchemy import func, select

from collector.recordings.export_format import EXPORT_COLUMNS
from collector.recordings.export_reader import read_export
from collector.recordings.export_writer import write_export
from collector.recordings.load import load_into_store
from collector.sources.replay import ReplaySource
from store.db import Store
from store.errors import InvalidInput
from store.migrations import upgrade
from store.models import DeviceSample, Host, ProcessSample, Workflow
from store.settings import get_settings
from tests.conftest import FLEET
from ui.cli import run
from ui.cli.export import parse_time

END = 2_000_000_000.0


def _fresh(tmp_path: Path, name: str) -> Store:
    store = Store(f"sqlite:///{tmp_path / name}")
    upgrade(store)
    return store


def _fingerprint(store: Store) -> tuple:
    with store.session() as s:
        dev = s.execute(select(func.count(), func.avg(DeviceSample.gpu_util), func.sum(DeviceSample.mem_used),
                               func.min(DeviceSample.ts), func.max(DeviceSample.ts))).one()
        proc = s.execute(select(func.count(), func.avg(ProcessSample.sm_util),
                                func.count(ProcessSample.workflow_id.distinct()))).one()
        teams = sorted((w.id, w.team) for w in s.scalars(select(Workflow)))
        hosts = sorted(s.scalars(select(Host.id)))
    return tuple(dev), tuple(proc), teams, hosts


@pytest.mark.parametrize("name", ["out.jsonl.gz", "out.csv.gz"])
def test_round_trip_through_an_export_file(any_store, tmp_path, name) -> None:
    load_into_store(any_store, FLEET, containers=10, end_at=END)
    summary = write_export(any_store, tmp_path / name)
    assert (summary.hosts, summary.devices, summary.workflows) == (2, 10, 10)
    assert summary.device_samples > 1000 and summary.format == ("csv" if ".csv" in name else "jsonl")
    copy = _fresh(tmp_path, "copy.db")
    loaded = load_into_store(copy, tmp_path / name, end_at=END)
    assert loaded.kind == "export" and loaded.skipped_rows == 0
    a, b = _fingerprint(any_store), _fingerprint(copy)
    assert a[0][0] == b[0][0] and a[0][1] == pytest.approx(b[0][1]) and a[0][2:] == b[0][2:]
    assert a[1][0] == b[1][0] and a[1][1] == pytest.approx(b[1][1]) and a[1][2] == b[1][2]
    assert a[2:] == b[2:]


@pytest.mark.parametrize("name", ["plain.jsonl", "plain.csv"])
def test_plain_files_round_trip_too(sqlite_store, tmp_path, name) -> None:
    load_into_store(sqlite_store, FLEET, containers=2, end_at=END)
    write_export(sqlite_store, tmp_path / name)
    copy = _fresh(tmp_path, "copy.db")
    load_into_store(copy, tmp_path / name, end_at=END)
    a, b = _fingerprint(sqlite_store)[0], _fingerprint(copy)[0]
    assert a[0] == b[0] and a[1] == pytest.approx(b[1]) and a[2:] == b[2:]


def test_a_time_range_exports_only_its_samples(sqlite_store, tmp_path) -> None:
    load_into_store(sqlite_store, FLEET, containers=4, end_at=END)
    out = tmp_path / "last-hour.jsonl.gz"
    summary = write_export(sqlite_store, out, start=END - 3600, end=END)
    rec = read_export(out)
    assert 0 < summary.device_samples == len(rec.device_samples) <= 4 * 64
    assert rec.device_samples["ts"].min() >= END - 3600 and rec.device_samples["ts"].max() == END


def test_an_export_plays_live(sqlite_store, tmp_path) -> None:
    load_into_store(sqlite_store, FLEET, containers=3, end_at=END)
    write_export(sqlite_store, tmp_path / "x.jsonl.gz")
    src = ReplaySource(tmp_path / "x.jsonl.gz", speedup=1000.0, clock=lambda: 5.0)
    readings = src.sample()
    assert len(readings) == 3
    assert all(p.workflow_id.startswith("alibaba-") for r in readings for p in r.processes)


def _write_jsonl(path: Path, lines: list[str]) -> Path:
    with gzip.open(path, "wt") as f:
        f.write("\n".join(lines) + "\n")
    return path


def test_malformed_records_are_skipped_counted_and_the_rest_loaded(sqlite_store, tmp_path, caplog) -> None:
    header = json.dumps({"kind": "fleetlens-export", "version": 1})
    good = [
        {"kind": "host", "id": "h1", "hostname": "h1", "labels": {}},
        {"kind": "device", "host_id": "h1", "index": 0, "uuid": "u-0", "name": "gpu", "memory_total": 1000},
        {"kind": "workflow", "id": "wf", "team": "t"},
        {"kind": "device_sample", "host_id": "h1", "device_index": 0, "ts": 100.0, "gpu_util": 0.5},
        {"kind": "device_sample", "host_id": "h1", "device_index": 0, "ts": 160.0, "gpu_util": 0.7},
        {"kind": "process_sample", "host_id": "h1", "device_index": 0, "workflow_id": "wf", "pid": 7, "ts": 160.0,
         "mem_used": 10, "sm_util": 0.7},
    ]
    bad = [
        "{not json",
        json.dumps({"kind": "device_sample", "host_id": "h1", "device_index": 0, "gpu_util": 0.1}),  # no ts
        json.dumps({"kind": "device_sample", "host_id": "h1", "device_index": 0, "ts": "soon"}),
        json.dumps({"kind": "device_sample", "host_id": "h9", "device_index": 3, "ts": 130.0}),  # unknown device
        json.dumps({"kind": "teapot"}),
        json.dumps([1, 2, 3]),
    ]
    path = _write_jsonl(tmp_path / "bad.jsonl.gz", [header, *(json.dumps(g) for g in good[:4]), *bad,
                                                     *(json.dumps(g) for g in good[4:])])
    with caplog.at_level(logging.WARNING, logger="collector.recordings.read"):
        summary = load_into_store(sqlite_store, path, end_at=END)
    assert summary.skipped_rows == 6 and "skipped 6 malformed rows" in caplog.text
    assert (summary.device_samples, summary.process_samples, summary.workflows) == (2, 1, 1)
    with sqlite_store.session() as s:
        assert list(s.scalars(select(DeviceSample.gpu_util).order_by(DeviceSample.ts))) == [0.5, 0.7]


def test_a_csv_without_the_columns_is_refused_naming_them(sqlite_store, tmp_path) -> None:
    path = tmp_path / "short.csv"
    path.write_text("kind,host_id,ts\ndevice_sample,h1,1.0\n")
    with pytest.raises(InvalidInput) as err:
        load_into_store(sqlite_store, path)
    text = str(err.value)
    assert "lacks columns" in text and "'device_index'" in text
    assert f"expected {list(EXPORT_COLUMNS)}" in text and "found ['kind', 'host_id', 'ts']" in text
    with sqlite_store.session() as s:
        assert s.scalar(select(func.count()).select_from(Host)) == 0


def test_a_jsonl_without_header_is_refused(sqlite_store, tmp_path) -> None:
    path = _write_jsonl(tmp_path / "nohead.jsonl.gz", [json.dumps({"kind": "host", "id": "h"})])
    with pytest.raises(InvalidInput, match="not a fleetlens export"):
        load_into_store(sqlite_store, path)


def test_a_bad_range_writes_nothing(sqlite_store, tmp_path) -> None:
    with pytest.raises(InvalidInput, match="starts"):
        write_export(sqlite_store, tmp_path / "x.jsonl.gz", start=10, end=5)
    with pytest.raises(InvalidInput, match="does not exist"):
        write_export(sqlite_store, tmp_path / "no" / "x.jsonl.gz")
    assert not [p for p in tmp_path.rglob("*x.jsonl.gz*")]  # neither the file nor a partial one


def test_cli_export_and_load_replay(fleet_home, tmp_path, capsys) -> None:
    assert run(["init"]) == 0
    store = Store.from_settings(get_settings(fresh=True))
    load_into_store(store, FLEET, containers=12)  # ends now, so --since is meaningful
    out = tmp_path / "last.csv.gz"
    assert run(["export", str(out), "--since", "2h", "--host", "alibaba-h00"]) == 0
    assert "1 hosts, 8 devices" in capsys.readouterr().out.replace("\n", " ")
    rec = read_export(out)
    assert set(rec.device_samples["host_id"]) == {"alibaba-h00"}
    assert rec.device_samples["ts"].max() - rec.device_samples["ts"].min() <= 2 * 3600
    assert run(["load-replay", str(out), "--host-prefix", "copy-"]) == 0
    assert "loaded export: 1 hosts, 8 devices" in capsys.readouterr().out.replace("\n", " ")
    with store.session() as s:
        assert sorted(s.scalars(select(Host.id))) == ["alibaba-h00", "alibaba-h01", "copy-alibaba-h00"]
    assert run(["export", str(out), "--since", "yesterday"]) == 2
    assert "neither epoch seconds nor a duration" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["nan", "inf", "-inf"])
def test_a_time_that_is_not_finite_is_refused(text) -> None:
    # float() reads these, but no time is NaN or infinite: a one-line error, not an empty export or a traceback
    with pytest.raises(InvalidInput, match="neither epoch seconds nor a duration"):
        parse_time(text)
