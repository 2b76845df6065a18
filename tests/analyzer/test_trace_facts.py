"""Facts of the real shared traces, counted from the raw JSON and found again by the analyzer and its rules."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from analyzer.traces.run import analyze_one, analyze_paths
from tests.analyzer.conftest import every_cost_thresholds, raw_events
from tests.conftest import TRACES


def _rules(found) -> dict:
    return {f.rule: f for f in found}


def test_alexnet_pageable_copies_and_stream_syncs_are_found_by_both_rules():
    events = raw_events("a100_alexnet_microbench.json.gz")
    pageable = [e for e in events if e.get("name") == "Memcpy HtoD (Pageable -> Device)"]
    syncs = [e for e in events if e.get("name") == "cudaStreamSynchronize"]
    assert len(pageable) == 16 and len(syncs) == 16  # checked by hand in the raw JSON

    # each costs under 1 % of the benchmark's 12.9 s span, too little to report by default (test_trace_rules.py)
    summary, found = analyze_one(TRACES / "a100_alexnet_microbench.json.gz", thresholds=every_cost_thresholds())
    rules = _rules(found)
    page = rules["trace.pageable_memcpy"]
    assert page.evidence["pageable_htod_copies"] == 16
    assert page.evidence["pageable_htod_bytes"] == sum(e["args"]["bytes"] for e in pageable)
    assert page.cost_s_per_step > 0 and page.gpu_hours_per_day(8) == 8 * page.gpu_hours_per_day(1)
    assert "pin_memory" in page.fix and "Pageable" in page.location
    sync = rules["trace.sync_heavy"]
    assert sync.evidence["stream_syncs"] == 16
    assert sync.evidence["device_syncs"] == 5
    assert "cudaStreamSynchronize" in sync.location
    # no ProfilerStep in a micro-benchmark: one step over the device's active span
    assert summary["n_steps"] == 1 and summary["steps"][0]["name"] == "device active span"


def test_fp32_sgemm_in_alexnet_is_a_tensor_core_opportunity():
    # a small one: TF32 would save 0.013 % of the benchmark's span, too little to report by default
    summary, found = analyze_one(TRACES / "a100_alexnet_microbench.json.gz", thresholds=every_cost_thresholds())
    tc = _rules(found)["trace.no_tensor_cores"]
    assert any("sgemm" in k["name"] for k in tc.evidence["top_kernels"])
    assert "allow_tf32" in tc.fix


def test_pinned_copies_never_get_the_pageable_finding(rank3):
    events = raw_events("a100_8rank_rank3_training.json.gz")
    htod = {e["name"] for e in events if e.get("cat") == "gpu_memcpy" and "HtoD" in e["name"]}
    assert htod == {"Memcpy HtoD (Pinned -> Device)"}
    summary, found = rank3
    assert "trace.pageable_memcpy" not in _rules(found)
    pinned = [r for r in summary["memcpy"] if r["direction"] == "HtoD"]
    assert pinned == [dict(pinned[0], host_memory="pinned", count=150)]
    assert summary["rank"] == 3 and summary["n_steps"] == 6
    # the parts of each step add up to its wall time
    for row in summary["breakdown"]:
        parts = row["computation_us"] + row["communication_us"] + row["memory_us"] + row["idle_us"]
        assert abs(parts - row["step_us"]) < 1e-6 * row["step_us"] + 1
        idle = row["host_wait_us"] + row["kernel_wait_us"] + row["other_idle_us"]
        assert abs(idle - row["idle_us"]) < 1e-6 * row["step_us"] + 1
    assert summary["dataloader"]["per_step"][0]["calls"] == 1  # enumerate(DataLoader) once per step
    # 60 cudaStreamSynchronize: 24 are the waits of device .item() calls, counted once as those .item()s
    assert (summary["sync"]["totals"]["stream_sync"], summary["sync"]["totals"]["item"]) == (36, 24)


def test_nccl_trace_has_communication():
    events = raw_events("a100_2rank_nccl.json.gz")
    nccl = [e for e in events if e.get("cat") == "kernel" and e["name"].startswith("ncclKernel")]
    assert nccl
    summary, _ = analyze_one(TRACES / "a100_2rank_nccl.json.gz")
    assert summary["overlap"]["communication_us"] > 0
    assert 0 <= summary["overlap"]["overlap_ratio"] <= 1
    assert summary["fractions"]["communication"] > 0
    assert sum(k["count"] for k in summary["overlap"]["top_comm_kernels"]) <= len(nccl)


def test_cpu_only_and_amd_traces_are_analysed_not_refused():
    res = analyze_paths([TRACES / "cpu_only_gloo_rank34.json.gz", TRACES / "cpu_ops_no_gpu.json.gz",
                         TRACES / "amd_mi250_minitoy.json.gz"])
    assert res.errors == {}
    cpu, cpu_ops, amd = res.summaries
    assert not cpu["has_gpu"] and cpu["rank"] == 34 and cpu["fractions"]["idle"] is None
    assert cpu["step_us_mean"] > 0
    assert cpu_ops["dataloader"]["per_step"][0]["calls"] == 1
    assert cpu_ops["sync"]["totals"]["item"] == 5
    assert amd["has_gpu"] and amd["launch"]["kernels"] == 14
    assert set(amd["launch"]["launch_names"]) == {"hipLaunchKernel", "hipExtModuleLaunchKernel"}
    # the MI250 GEMMs are MFMA (tensor-core) kernels
    assert amd["tensor_cores"]["tensor_core_us"] > 0
    # no distributedInfo: rank 0 with a warning
    assert amd["rank"] == 0 and any("no distributedInfo.rank" in w for w in amd["warnings"])


def test_sampled_128rank_pair_gives_a_straggler_verdict_with_numbers():
    res = analyze_paths([TRACES / "sampled_128rank_rank0.json.gz", TRACES / "sampled_128rank_rank1.json.gz"])
    v = res.straggler
    assert v is not None and v["ranks"] == [0, 1]
    assert set(v["per_rank_us"]) == {"0", "1"} and all(x > 0 for x in v["per_rank_us"].values())
    assert v["is_straggler"] == (v["excess"] >= v["threshold"])
    stragglers = [f for f in res.findings if f.rule == "trace.straggler"]
    assert len(stragglers) == (1 if v["is_straggler"] else 0)
    if stragglers:
        assert stragglers[0].evidence["slowest_rank"] == v["slowest_rank"]


def test_unrelated_files_are_not_compared_as_ranks():
    res = analyze_paths([TRACES / "a100_triton_kernel.json.gz", TRACES / "cpu_only_gloo_rank34.json.gz"])
    assert res.straggler is None
    assert not [f for f in res.findings if f.rule == "trace.straggler"]


def _captured_a_day_later(name: str, out: Path) -> Path:
    """A copy of a shared trace as if the same rank of another job had been captured a day later: Kineto's
    `baseTimeNanoseconds` moves every event time by one day."""
    with gzip.open(TRACES / name, "rt") as fh:
        doc = json.load(fh)
    assert "baseTimeNanoseconds" not in doc  # its times are on the clock itself
    doc["baseTimeNanoseconds"] = 86_400 * 10**9
    path = out / f"later_{name}"
    with gzip.open(path, "wt") as fh:
        json.dump(doc, fh)
    return path


def test_ranks_are_compared_only_with_ranks_captured_at_the_same_time(tmp_path):
    rank0, rank1 = TRACES / "sampled_128rank_rank0.json.gz", TRACES / "sampled_128rank_rank1.json.gz"
    later1 = _captured_a_day_later("sampled_128rank_rank1.json.gz", tmp_path)
    together = analyze_paths([rank0, rank1])
    w0, w1 = (s["window_us"] for s in together.summaries)
    assert w0[0] < w1[1] and w1[0] < w0[1]  # the two ranks' captures overlap

    # a folder with this job's two ranks and another capture's rank 1: the same world size, but not compared
    mixed = analyze_paths([rank0, rank1, later1])
    assert len(mixed.summaries) == 3
    assert mixed.summaries[2]["window_us"][0] > w1[1] + 86_000e6
    assert mixed.straggler == together.straggler and mixed.straggler["ranks"] == [0, 1]
    assert mixed.straggler["per_rank_us"] == together.straggler["per_rank_us"]

    # rank 0 of one capture and rank 1 of another are not one job
    apart = analyze_paths([rank0, later1])
    assert apart.straggler is None
    assert not [f for f in apart.findings if f.rule == "trace.straggler"]
