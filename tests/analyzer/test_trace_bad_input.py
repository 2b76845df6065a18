"""Corrupted copies of the shared traces: each refused with the file and the problem, the rest still analysed."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from sqlalchemy import select

from analyzer.traces import InvalidTrace, analyze_paths, analyze_trace, register_trace
from analyzer.traces.parse import parse_trace
from analyzer.traces.stream_read import stream_trace
from store.errors import InvalidInput
from store.models import Finding, Trace
from store.settings import get_settings
from tests.conftest import TRACES
from ui.cli import run

GOOD = TRACES / "a100_alexnet_microbench.json.gz"


def _truncated(tmp: Path) -> Path:
    data = GOOD.read_bytes()
    p = tmp / "truncated.json.gz"
    p.write_bytes(data[: len(data) // 2])
    return p


def _not_json(tmp: Path) -> Path:
    p = tmp / "not_json.json.gz"
    with gzip.open(GOOD, "rb") as fh:
        text = fh.read()
    p.write_bytes(gzip.compress(b"<html>" + text[:1000]))
    return p


def _no_events(tmp: Path) -> Path:
    with gzip.open(GOOD, "rb") as fh:
        record = json.loads(fh.read())
    del record["traceEvents"]
    p = tmp / "no_events.json"
    p.write_text(json.dumps(record))
    return p


def _empty(tmp: Path) -> Path:
    p = tmp / "empty.json.gz"
    p.write_bytes(b"")
    return p


CASES = {
    "truncated": (_truncated, "truncated"),
    "not_json": (_not_json, "not valid JSON"),
    "no_events": (_no_events, "no traceEvents"),
    "empty": (_empty, "empty"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_file_is_refused_naming_the_file_and_problem(tmp_path, case):
    make, problem = CASES[case]
    path = make(tmp_path)
    with pytest.raises(InvalidTrace) as err:
        parse_trace(path)
    assert isinstance(err.value, InvalidInput)
    assert str(path) in str(err.value) and problem in str(err.value)


def test_file_larger_than_memory_allows_is_refused_up_front(tmp_path):
    with pytest.raises(InvalidTrace, match="too large to analyse here"):
        parse_trace(GOOD, memory_budget=1024 * 1024)


def test_one_bad_file_does_not_stop_the_others(tmp_path):
    bad = _truncated(tmp_path)
    res = analyze_paths([bad, GOOD, tmp_path / "missing.json"])
    assert [s["path"] for s in res.summaries] == [str(GOOD)]
    assert set(res.errors) == {str(bad), str(tmp_path / "missing.json")}
    assert "truncated" in res.errors[str(bad)]


def test_cli_exits_2_when_any_trace_failed(tmp_path, fleet_home, capsys):
    bad = _not_json(tmp_path)
    code = run(["analyze", str(bad), str(GOOD), "--json"])
    assert code == 2
    out = json.loads(capsys.readouterr().out)
    assert len(out["traces"]) == 1 and str(bad) in out["errors"]
    assert run(["analyze", str(GOOD), "--json"]) == 0


def test_store_marks_bad_trace_failed_with_reason_and_analyses_the_rest(tmp_path, any_store):
    from analyzer.traces import analyze_pending

    bad_id = register_trace(any_store, _empty(tmp_path), workflow_id="wf-bad")
    good_id = register_trace(any_store, GOOD, workflow_id="wf-good")
    counts = analyze_pending(any_store, cache_dir=tmp_path / "cache")
    assert counts == {"analyzed": 1, "failed": 1}
    with any_store.session() as s:
        bad, good = s.get(Trace, bad_id), s.get(Trace, good_id)
        assert bad.status == "failed" and "empty" in bad.error and "empty.json.gz" in bad.error
        assert good.status == "analyzed" and good.summary["n_steps"] == 1
        assert not s.scalars(select(Finding).where(Finding.workflow_id == "wf-bad")).all()
    again = analyze_trace(any_store, bad_id, cache_dir=tmp_path / "cache")
    assert again["status"] == "failed"


def test_a_trace_another_host_wrote_and_this_one_cannot_read_says_where_to_put_traces(tmp_path, sqlite_store,
                                                                                      fleet_home, monkeypatch):
    monkeypatch.setenv("FLEETLENS_HOST_ID", "analyzer-host")
    get_settings(fresh=True)
    elsewhere = tmp_path / "gpu-node-7" / "traces" / "rank0.json.gz"  # a path on the job's host only
    gone = tmp_path / "gone.json.gz"
    elsewhere.parent.mkdir(parents=True)
    for path in (elsewhere, gone):
        path.write_bytes(b"")
    there = register_trace(sqlite_store, elsewhere, workflow_id="wf-far", host_id="gpu-node-7")
    here = register_trace(sqlite_store, gone, workflow_id="wf-near", host_id="analyzer-host")
    for path in (elsewhere, gone):  # the analyzer's host does not see the first; the second was deleted
        path.unlink()
    host = get_settings().host_id  # the analyzing host, as the entry points pass it down
    assert analyze_trace(sqlite_store, there, cache_dir=tmp_path / "cache", host_id=host)["status"] == "failed"
    analyze_trace(sqlite_store, here, cache_dir=tmp_path / "cache", host_id=host)
    with sqlite_store.session() as s:
        far, near = s.get(Trace, there), s.get(Trace, here)
        assert far.status == "failed" and "no such file here on analyzer-host; host gpu-node-7 wrote it" in far.error
        assert "shared storage" in far.error
        assert near.status == "failed" and "no such file" in near.error and "shared storage" not in near.error


def _first(events: list[dict], cat: str, arg: str | None = None) -> dict:
    return next(e for e in events if e.get("cat") == cat and (arg is None or arg in (e.get("args") or {})))


MALFORMED = {  # what is changed in the first such event, the field the error names
    "cpu correlation a string": (lambda ev: _first(ev, "cuda_runtime", "correlation")["args"].update(correlation="12"),
                                 "correlation"),
    "kernel correlation a string": (lambda ev: _first(ev, "kernel")["args"].update(correlation="12"), "correlation"),
    "ts a string": (lambda ev: _first(ev, "kernel").update(ts="x"), "ts"),
    "dur a string": (lambda ev: _first(ev, "kernel").update(dur="12"), "dur"),
    "cat a list": (lambda ev: _first(ev, "kernel").update(cat=["kernel"]), "cat"),
    "name missing": (lambda ev: _first(ev, "kernel").pop("name"), "name"),
    "bytes a string": (lambda ev: _first(ev, "gpu_memcpy")["args"].update(bytes="4"), "bytes"),
}


def _changed(tmp: Path, change) -> Path:
    with gzip.open(GOOD, "rb") as fh:
        record = json.loads(fh.read())
    change(record["traceEvents"])
    p = tmp / "changed.json"
    p.write_text(json.dumps(record))
    return p


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_event_is_refused_naming_the_file_and_field_by_both_readers(tmp_path, case):
    change, field = MALFORMED[case]
    path = _changed(tmp_path, change)
    with pytest.raises(InvalidTrace) as err:
        stream_trace(path)
    assert str(path) in str(err.value) and "malformed events (event " in str(err.value) and field in str(err.value)
    with pytest.raises(InvalidTrace, match="malformed events"):  # the reference reader, in HTA's words
        parse_trace(path)


def test_a_malformed_file_among_good_ones_is_an_error_alone(tmp_path, fleet_home, capsys):
    bad = _changed(tmp_path, MALFORMED["ts a string"][0])
    res = analyze_paths([GOOD, bad])
    assert [s["path"] for s in res.summaries] == [str(GOOD)]
    assert "malformed events" in res.errors[str(bad)]
    assert run(["analyze", str(GOOD), str(bad), "--json"]) == 2
    out = json.loads(capsys.readouterr().out)
    assert len(out["traces"]) == 1 and "ts is a str" in out["errors"][str(bad)]
