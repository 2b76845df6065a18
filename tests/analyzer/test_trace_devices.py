"""Device kinds named from the trace, advice in that device's API, and rules that cannot judge a trace saying why.

The shared traces give CUDA (A100), ROCm/HIP (MI250) and CPU-only captures. A counter-mode capture, an MTIA
capture and an unknown runtime are copies of the real AlexNet trace with its events changed the way such a
capture differs (no device activity but cuda_profiler_range events; mtia* runtime calls; unknown runtime names).
"""

from __future__ import annotations

import gzip
import io
import json
import re
from pathlib import Path

import pytest
from rich.console import Console

from analyzer.report import print_report
from analyzer.rules import launch_bound, per_rank_rules, straggler, sync_heavy, tiny_steps
from analyzer.rules.devices import DEVICE_APIS, not_judged
from analyzer.traces.run import analyze_one, analyze_paths
from tests.analyzer.conftest import every_cost_thresholds, words_of_other_devices
from tests.conftest import TRACES

ALEXNET = TRACES / "a100_alexnet_microbench.json.gz"
DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def _report(res) -> str:
    out = io.StringIO()
    print_report(res, Console(file=out, width=200))
    return out.getvalue()


def _copy(tmp: Path, name: str, change) -> Path:
    with gzip.open(ALEXNET, "rb") as fh:
        record = json.loads(fh.read())
    change(record)
    out = tmp / name
    out.write_text(json.dumps(record))
    return out


@pytest.mark.parametrize(("name", "kind"), [
    ("a100_alexnet_microbench.json.gz", "cuda"),
    ("amd_mi250_minitoy.json.gz", "rocm"),
    ("sampled_128rank_rank0.json.gz", "cuda"),  # no deviceProperties: known by its cudaLaunchKernel calls
    ("cpu_only_gloo_rank34.json.gz", "cpu"),
    ("cpu_ops_no_gpu.json.gz", "cpu"),
])
def test_device_kind_is_detected_from_the_trace(name, kind):
    summary, _ = analyze_one(TRACES / name)
    assert summary["device_kind"]["kind"] == kind and summary["device_kind"]["why"]


def test_rocm_advice_names_hip_and_matrix_cores():
    # host_bound's idle time is all tiny_steps' here: reported only when every finding is
    summary, found = analyze_one(TRACES / "amd_mi250_minitoy.json.gz", thresholds=every_cost_thresholds())
    host = next(f for f in found if f.rule == "trace.host_bound")
    assert "HIP graphs" in host.fix and "CUDA graphs" not in host.fix
    assert summary["device_kind"]["label"] == "ROCm/HIP (AMD)"


def test_cpu_only_trace_says_which_rules_cannot_judge_it():
    res = analyze_paths([TRACES / "cpu_ops_no_gpu.json.gz"])
    summary = res.summaries[0]
    # .item() calls of a CPU trace are no device syncs: sync_heavy does not judge it (it used to fire here)
    assert not res.findings
    assert "do not wait for a device" in summary["rules_not_judged"]["trace.sync_heavy"]
    assert "CPU only" in summary["rules_not_judged"]["trace.host_bound"]
    out = _report(res)
    assert "CPU only" in out and "not judged" in out and "n/a" not in out


def test_counter_mode_capture_has_no_kernel_timeline_and_says_so(tmp_path):
    def counters(record):
        events = [e for e in record["traceEvents"] if e.get("cat") not in DEVICE_CATS]
        events.append({"ph": "X", "cat": "cuda_profiler_range", "name": "range0", "pid": 0, "tid": 0,
                       "ts": events[-1]["ts"], "dur": 100, "args": {"sm__cycles_elapsed.avg": 1000}})
        record["traceEvents"] = events

    path = _copy(tmp_path, "counters.json", counters)
    res = analyze_paths([path])
    dk = res.summaries[0]["device_kind"]
    assert dk["kind"] == "cuda" and not dk["kernel_timeline"]
    why = res.summaries[0]["rules_not_judged"]
    assert why["trace.host_bound"] == ("no kernel timeline: this trace was captured with CUPTI counters only "
                                       "(cuda_profiler_range)")
    assert not [f for f in res.findings if f.rule in why]
    assert "CUPTI counters only" in _report(res)


def _mtia(record):
    record["deviceProperties"] = [{"id": 0, "name": "MTIA v2"}]
    for e in record["traceEvents"]:
        if str(e.get("name", "")).startswith("cuda"):
            e["name"] = "mtia" + e["name"][4:]


def test_mtia_capture_gets_mtia_advice(tmp_path):
    # AlexNet's syncs cost under 1 % of its span: reported only when every finding is
    summary, found = analyze_one(_copy(tmp_path, "mtia.json", _mtia), thresholds=every_cost_thresholds())
    assert summary["device_kind"]["kind"] == "mtia"
    assert "tensor-core kernels are known by NVIDIA and AMD" in summary["rules_not_judged"]["trace.no_tensor_cores"]
    sync = next(f for f in found if f.rule == "trace.sync_heavy")
    assert "torch.mtia.synchronize()" in sync.fix and "torch.cuda.synchronize()" not in sync.fix


def test_unknown_device_kind_is_stated_and_not_guessed(tmp_path):
    def unknown(record):
        record.pop("deviceProperties", None)
        for e in record["traceEvents"]:
            if e.get("cat") in ("cuda_runtime", "cuda_driver"):
                e["name"] = "xpuRuntimeCall"

    res = analyze_paths([_copy(tmp_path, "unknown.json", unknown)])
    dk = res.summaries[0]["device_kind"]
    assert dk["kind"] == "unknown" and "no known runtime call names" in dk["why"]
    assert "trace.no_tensor_cores" in res.summaries[0]["rules_not_judged"]
    assert "unknown device" in _report(res)


def test_hip_module_launches_are_launch_calls(tmp_path):
    # Triton kernels on ROCm are launched by hipModuleLaunchKernel: the MI250 trace with its hipLaunchKernel calls
    # named so keeps every launch and its CPU time
    with gzip.open(TRACES / "amd_mi250_minitoy.json.gz", "rb") as fh:
        record = json.loads(fh.read())
    launches = [e for e in record["traceEvents"] if e.get("name") in ("hipLaunchKernel", "hipExtModuleLaunchKernel")]
    for e in launches:
        if e["name"] == "hipLaunchKernel":
            e["name"] = "hipModuleLaunchKernel"
    path = tmp_path / "mi250_module_launch.json"
    path.write_text(json.dumps(record))
    summary, _ = analyze_one(path)
    la = summary["launch"]
    assert la["launch_calls"] == len(launches) == 14
    # the frame's times are whole microseconds: up to 2 us less per call
    assert la["launch_cpu_total_us"] == pytest.approx(sum(e["dur"] for e in launches), abs=2 * len(launches))
    assert set(la["launch_names"]) == {"hipModuleLaunchKernel", "hipExtModuleLaunchKernel"}


@pytest.mark.parametrize("kind", ["rocm", "mtia", "cpu", "unknown"])
def test_every_rules_advice_names_the_devices_own_api(kind):
    # each rule's advice as it reads on this device, for every rule that can judge such a trace
    api = DEVICE_APIS[kind]
    judged = [r for r in per_rank_rules() + [straggler]
              if r.RULE not in not_judged({"device_kind": {"kind": kind, "kernel_timeline": True}}, [r.RULE])]
    assert straggler in judged and tiny_steps in judged
    for rule in judged:
        assert words_of_other_devices(rule.advice(api), kind) == [], rule.RULE
    if kind == "rocm":
        assert "HIP graph" in tiny_steps.advice(api) and "HIP graph" in launch_bound.advice(api)


@pytest.mark.parametrize(("kind", "trace"), [("rocm", "amd_mi250_minitoy.json.gz"), ("mtia", "mtia")])
def test_findings_on_a_non_cuda_trace_advise_no_cuda_only_call(tmp_path, kind, trace):
    # every finding, however little it costs; the CPU-only kind is checked on the demo's tiny-steps job
    # (test_demo_jobs.py): the shared CPU traces have no finding
    path = _copy(tmp_path, "mtia.json", _mtia) if trace == "mtia" else TRACES / trace
    summary, found = analyze_one(path, thresholds=every_cost_thresholds())
    assert summary["device_kind"]["kind"] == kind
    assert len(found) >= 2
    for f in found:
        assert words_of_other_devices(f.fix, kind) == [], f.rule
    if kind == "rocm":
        steps = next(f for f in found if f.rule == "trace.tiny_steps")
        assert "replays the step as a HIP graph" in steps.fix  # it used to say "as a CUDA graph"


CUDA_CALL = r"\bcuda[A-Z]\w*"


def test_rocm_sync_title_names_the_hip_call_the_trace_has():
    # the MI250 trace's one hipDeviceSynchronize, reported however few calls per step (it used to be titled
    # "1 cudaDeviceSynchronize")
    th = every_cost_thresholds()
    th = {**th, "sync_heavy": {**th["sync_heavy"], "calls_per_step_min": 0}}
    _, found = analyze_one(TRACES / "amd_mi250_minitoy.json.gz", thresholds=th)
    sync = next(f for f in found if f.rule == "trace.sync_heavy")
    assert "(1 hipDeviceSynchronize in the trace)" in sync.title
    for f in found:
        assert words_of_other_devices(f.title + " " + f.location, "rocm") == [], f.rule


def test_hip_stream_and_event_syncs_are_counted_under_their_own_names(tmp_path):
    # the MI250 trace with six hipStreamSynchronize and three hipEventSynchronize calls in its first step (4.5 per step)
    with gzip.open(TRACES / "amd_mi250_minitoy.json.gz", "rb") as fh:
        record = json.loads(fh.read())
    events = record["traceEvents"]
    sync = next(e for e in events if e.get("name") == "hipDeviceSynchronize")
    step = next(e for e in events if e.get("name") == "ProfilerStep#1" and e.get("cat") == "user_annotation")
    for i, name in enumerate(["hipStreamSynchronize"] * 6 + ["hipEventSynchronize"] * 3):
        events.append({**sync, "name": name, "ts": step["ts"] + 100 * (i + 1), "dur": 50,
                       "args": {"correlation": 900 + i, "External id": 900 + i}})
    path = tmp_path / "mi250_syncs.json"
    path.write_text(json.dumps(record))
    _, found = analyze_one(path, thresholds=every_cost_thresholds())
    title = next(f for f in found if f.rule == "trace.sync_heavy").title
    assert "(6 hipStreamSynchronize, 1 hipDeviceSynchronize, 3 hipEventSynchronize in the trace)" in title
    assert not re.findall(CUDA_CALL, title)


def test_mtia_titles_and_locations_name_the_mtia_calls(tmp_path):
    _, found = analyze_one(_copy(tmp_path, "mtia.json", _mtia), thresholds=every_cost_thresholds())
    by_rule = {f.rule: f for f in found}
    assert "(16 mtiaStreamSynchronize, 5 mtiaDeviceSynchronize in the trace)" in by_rule["trace.sync_heavy"].title
    assert "the MTIA device drains its queue" in by_rule["trace.sync_heavy"].title
    assert ("'Memcpy HtoD (Pageable -> Device)' on the MTIA device (mtiaMemcpyAsync on the CPU)"
            in by_rule["trace.pageable_memcpy"].location)
    # the device it ran on, not "GPU": "GPU idle 99 % of each step", "GPU active span" (the one step of a trace
    # without ProfilerStep spans) were in the titles and locations of this MTIA trace
    assert by_rule["trace.host_bound"].title.startswith("MTIA device idle 99% of each step")
    assert "rank 0 (mtia.json), device active span, ts" in by_rule["trace.host_bound"].location
    for f in found:
        assert not re.findall(CUDA_CALL, f.title + " " + f.location), f.rule
        assert not re.findall(r"\bGPU\b", f"{f.title} {f.location} {f.fix}"), f.rule


def test_rocm_copies_say_the_trace_cannot_tell_pageable_from_pinned():
    # Kineto's ROCm tracers name a copy's host side "Host" from its direction alone (the MI250 trace's two uploads:
    # "Memcpy HtoD (Host -> Device)", their hipMemcpyWithStream calls recording pointers, a size and kind 1, HtoD):
    # pageable_memcpy could never fire on ROCm, and said nothing about it
    res = analyze_paths([TRACES / "amd_mi250_minitoy.json.gz"], thresholds=every_cost_thresholds())
    summary = res.summaries[0]
    assert [(r["direction"], r["host_memory"], r["count"], r["calls"]) for r in summary["memcpy"]] == [
        ("HtoD", "host", 2, ["hipMemcpyWithStream"])]
    assert summary["rules_not_judged"]["trace.pageable_memcpy"] == (
        "the copy kind is unknown on this device: its 2 host-to-device copies name their host memory 'Host', "
        "pageable or pinned alike (ROCm/HIP (AMD) traces do not record which)")
    assert "trace.pageable_dtoh" not in summary["rules_not_judged"]  # no readbacks to judge
    assert not [f for f in res.findings if f.rule.startswith("trace.pageable")]
    out = _report(res)
    assert "not judged: pageable_memcpy" in out and "copy kind is unknown on this device" in out


def test_rocm_readbacks_say_the_trace_cannot_tell_pageable_from_pinned():
    summary = {"device_kind": {"kind": "rocm", "label": "ROCm/HIP (AMD)", "kernel_timeline": True},
               "memcpy": [{"direction": "DtoH", "host_memory": "host", "count": 30},
                          {"direction": "DtoD", "host_memory": "device", "count": 4}]}
    why = not_judged(summary, ["trace.pageable_memcpy", "trace.pageable_dtoh"])
    assert list(why) == ["trace.pageable_dtoh"] and "its 30 device-to-host copies" in why["trace.pageable_dtoh"]
    # a trace that names its copies' host memory is judged
    summary["memcpy"][0]["host_memory"] = "pageable"
    assert not not_judged(summary, ["trace.pageable_memcpy", "trace.pageable_dtoh"])


def test_cuda_titles_and_locations_keep_the_cuda_calls():
    _, found = analyze_one(ALEXNET, thresholds=every_cost_thresholds())
    by_rule = {f.rule: f for f in found}
    assert by_rule["trace.sync_heavy"].title.startswith(
        "20 synchronising calls per step (16 cudaStreamSynchronize, 5 cudaDeviceSynchronize in the trace); the GPU "
        "drains its queue")
    assert ("'Memcpy HtoD (Pageable -> Device)' on the GPU (cudaMemcpyAsync on the CPU), first at"
            in by_rule["trace.pageable_memcpy"].location)


def test_a_summary_without_call_names_titles_syncs_by_kind():
    # a summary stored before the calls' own names were kept names no runtime's calls
    sy = {"totals": {"stream_sync": 4, "device_sync": 0, "event_sync": 1, "item": 2}}
    assert sync_heavy.call_counts(sy) == ["4 stream syncs", "1 event syncs", "2 .item()"]
