"""The streaming reader against the reference reader: same summaries and findings on every shared trace; cut,
corrupt and over-limit files refused saying how far the read got, with the complete steps before a cut kept.

The reference is analyzer.traces.parse.parse_trace: every event in one frame, held equal to HTA's own parser by
tests/analyzer/test_trace_reader.py (and cross-checked against HTA's analyses in test_hta_agreement.py, which reads
with the streaming reader).
"""

from __future__ import annotations

import gzip
import math
from pathlib import Path
from typing import Any

import orjson
import pytest

from analyzer.rules import rules_not_judged, run_rules, run_set_rules
from analyzer.rules.straggler import straggler_verdict
from analyzer.traces import InvalidTrace
from analyzer.traces.cache import TraceBounds
from analyzer.traces.parse import parse_trace
from analyzer.traces.run import analyze_one, analyze_paths, job_ranks
from analyzer.traces.stream_read import TruncatedTrace, stream_trace
from analyzer.traces.summary import summarize
from store.settings import Settings
from tests.conftest import TRACES

ALL = sorted(p.name for p in TRACES.glob("*.json.gz"))
A100 = "a100_80gb_16rank_rank0_training.json.gz"


def _same(a: Any, b: Any, where: str = "") -> list[str]:
    """Differences between two JSON-like values; numbers equal to 1e-9 (a sum taken in another order)."""
    if isinstance(a, bool) or isinstance(b, bool) or not isinstance(a, int | float) or not isinstance(b, int | float):
        if isinstance(a, dict) and isinstance(b, dict):
            return [d for k in sorted(set(a) | set(b), key=str) for d in _same(a.get(k), b.get(k), f"{where}.{k}")]
        if isinstance(a, list) and isinstance(b, list):
            if len(a) != len(b):
                return [f"{where}: {len(a)} items != {len(b)}"]
            return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in _same(x, y, f"{where}[{i}]")]
        return [] if a == b else [f"{where}: {a!r} != {b!r}"]
    return [] if math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9) else [f"{where}: {a} != {b}"]


def _reference(path: Path, th: dict) -> tuple[dict, list]:
    summary = summarize(parse_trace(path), consecutive_kernel_delay_us=th["common"]["consecutive_kernel_delay_us"],
                        tiny_kernel_us=th["common"]["tiny_kernel_us"])
    summary["rules_not_judged"] = rules_not_judged(summary)
    return summary, run_rules(summary, th)


@pytest.mark.parametrize("name", ALL)
def test_streaming_gives_the_reference_summary_and_findings(name, thresholds):
    ref_summary, ref_found = _reference(TRACES / name, thresholds)
    summary, found = analyze_one(TRACES / name, thresholds=thresholds)
    assert _same(ref_summary, summary) == []
    # rules, evidence values and GPU-hours (on an 8-GPU job, so the GPU-hours are not 1-GPU figures)
    assert _same([f.as_dict(8) for f in ref_found], [f.as_dict(8) for f in found]) == []
    assert [f.rule for f in found] == [f.rule for f in ref_found]
    assert summary["events"] > 0


def test_ranks_of_one_job_give_the_reference_straggler_and_set_findings(thresholds):
    names = ["sampled_128rank_rank0.json.gz", "sampled_128rank_rank1.json.gz"]
    ref = [_reference(TRACES / n, thresholds)[0] for n in names]
    res = analyze_paths([TRACES / n for n in names], thresholds=thresholds)
    assert not res.errors and len(res.summaries) == 2
    ranks = job_ranks(ref)
    assert len(ranks) == 2
    assert _same(straggler_verdict(ranks, thresholds["straggler"]["excess_min"]), res.straggler) == []
    ref_set = [f.as_dict(2) for f in run_set_rules(ranks, thresholds)]
    got_set = [f.as_dict(2) for f in res.findings if f.rule in {d["rule"] for d in ref_set}]
    assert _same(ref_set, got_set[-len(ref_set):] if ref_set else []) == []


def test_layout_and_block_size_do_not_change_the_result(tmp_path):
    """One-line JSON, plain text, and blocks far smaller than the trace give the same frame as the gzipped file."""
    with gzip.open(TRACES / A100, "rb") as fh:
        record = orjson.loads(fh.read())
    one_line = tmp_path / "one_line.json"
    one_line.write_bytes(orjson.dumps(record))
    base = summarize(stream_trace(TRACES / A100))
    for path, block in ((one_line, 1 << 16), (TRACES / A100, 1 << 16), (one_line, 64 << 20)):
        got = summarize(stream_trace(path, block_bytes=block))
        got["path"] = base["path"]
        assert _same(base, got) == [], (path.name, block)


def _cut(tmp: Path, fraction: float, gz: bool) -> Path:
    with gzip.open(TRACES / A100, "rb") as fh:
        text = fh.read()
    body = text[: int(len(text) * fraction)]
    if gz:
        whole = gzip.compress(body + text[len(body):])
        p = tmp / "cut.json.gz"
        p.write_bytes(whole[: int(len(whole) * fraction)])
    else:
        p = tmp / "cut.json"
        p.write_bytes(body)
    return p


@pytest.mark.parametrize("gz", [False, True])
def test_truncated_trace_says_how_far_and_keeps_the_complete_steps(tmp_path, thresholds, gz):
    full, _ = analyze_one(TRACES / A100, thresholds=thresholds)
    path = _cut(tmp_path, 0.8, gz)
    with pytest.raises(TruncatedTrace) as err:
        analyze_one(path, thresholds=thresholds)
    msg = str(err.value)
    assert str(path) in msg and "truncated" in msg and "whole events" in msg and "MiB" in msg
    assert "complete step" in msg
    partial, _ = err.value.partial_result
    n = partial["n_steps"]
    assert 1 <= n < full["n_steps"]
    assert any("truncated" in w for w in partial["warnings"])
    # the complete steps are whole: each one's breakdown and span are the ones the full trace gives it (the device
    # events are not written in time order, so these need not be the first steps)
    by_step = {row["step"]: row for row in full["breakdown"]}
    assert _same([by_step[row["step"]] for row in partial["breakdown"]], partial["breakdown"]) == []
    spans = {row["step"]: row for row in full["steps"]}
    assert _same([spans[row["step"]] for row in partial["steps"]], partial["steps"]) == []
    # analyze_paths keeps both: the error for the file and the summary of what was whole
    res = analyze_paths([path, TRACES / "a100_alexnet_microbench.json.gz"], thresholds=thresholds)
    assert set(res.errors) == {str(path)} and len(res.summaries) == 2


def test_a_cut_before_any_complete_step_is_an_error_alone(tmp_path):
    path = _cut(tmp_path, 0.3, gz=False)  # the CPU operators whole, none of the device's events
    with pytest.raises(TruncatedTrace, match="no profiler step is complete") as err:
        stream_trace(path)
    assert err.value.partial is None


def test_corrupt_text_in_the_middle_names_the_place(tmp_path):
    with gzip.open(TRACES / A100, "rb") as fh:
        text = bytearray(fh.read())
    mid = len(text) // 2
    text[mid:mid + 40] = b"@" * 40
    path = tmp_path / "corrupt.json"
    path.write_bytes(bytes(text))
    with pytest.raises(InvalidTrace) as err:
        stream_trace(path, block_bytes=1 << 20)
    msg = str(err.value)
    assert "not valid JSON" in msg and "whole events" in msg


def test_a_null_correlation_id_is_no_correlation_as_in_the_reference(tmp_path, thresholds):
    with gzip.open(TRACES / "a100_alexnet_microbench.json.gz", "rb") as fh:
        record = orjson.loads(fh.read())
    launch = next(e for e in record["traceEvents"]
                  if e.get("cat") == "cuda_runtime" and "correlation" in (e.get("args") or {}))
    launch["args"]["correlation"] = None
    path = tmp_path / "null_correlation.json"
    path.write_bytes(orjson.dumps(record))
    ref_summary, ref_found = _reference(path, thresholds)
    summary, found = analyze_one(path, thresholds=thresholds)
    assert _same(ref_summary, summary) == []
    assert _same([f.as_dict(8) for f in ref_found], [f.as_dict(8) for f in found]) == []


def test_memory_limit_refuses_a_trace_whose_columns_would_pass_it():
    with pytest.raises(InvalidTrace, match="memory limit"):
        analyze_one(TRACES / A100, memory_budget=256 * 1024)


def test_the_bounds_come_from_the_callers_settings(tmp_path: Path):
    bounds = TraceBounds.from_settings(Settings(home=tmp_path, trace_block_mb=3, trace_memory_mb=16))
    assert (bounds.block_bytes, bounds.memory_bytes) == (3 << 20, 16 << 20)
    tight = TraceBounds(block_bytes=1 << 20, memory_bytes=256 * 1024)
    assert "memory limit" in analyze_paths([TRACES / A100], bounds=tight).errors[str(TRACES / A100)]
    assert not analyze_paths([TRACES / A100], bounds=bounds).errors


def test_progress_reports_bytes_and_events_up_to_the_whole_file():
    seen: list[tuple[int, int, int]] = []
    stream_trace(TRACES / A100, block_bytes=1 << 20, progress=lambda *a: seen.append(a))
    size = (TRACES / A100).stat().st_size
    assert len(seen) > 3
    assert [s[0] for s in seen] == sorted(s[0] for s in seen) and seen[-1][0] == size
    assert all(s[1] == size for s in seen)
    with gzip.open(TRACES / A100, "rb") as fh:
        assert seen[-1][2] == len(orjson.loads(fh.read())["traceEvents"])
