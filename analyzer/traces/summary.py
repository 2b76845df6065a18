"""Run every per-rank question over one parsed trace and gather the answers in one JSON-able summary."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from analyzer.traces.breakdown import mean_fractions, step_breakdown
from analyzer.traces.cpu_work import math_per_step
from analyzer.traces.dataloader import dataloader_per_step
from analyzer.traces.device import device_kind
from analyzer.traces.events import gpu_events, has_gpu
from analyzer.traces.kernels import launch_stats, tensor_core_usage, top_kernels
from analyzer.traces.memcpy import memcpy_by_kind
from analyzer.traces.names import MEMCPY_CALL_RE
from analyzer.traces.overlap import comm_comp_overlap
from analyzer.traces.parse import ParsedTrace
from analyzer.traces.sync import sync_calls, sync_per_step


def _clean(value: Any) -> Any:
    """Plain JSON values: numpy scalars to Python, NaN/inf to None."""
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _records(df: pd.DataFrame) -> list[dict[str, Any]]:
    return _clean(df.astype(object).where(df.notna(), None).to_dict("records"))


def clock_window(t: ParsedTrace) -> list[float]:
    """The capture's first and last microsecond on the host's clock, so that ranks captured together can be told
    from ranks of other captures: Kineto writes event times relative to `baseTimeNanoseconds` when the file has
    one, else on the clock itself."""
    base = t.meta.get("baseTimeNanoseconds")
    offset = float(base) / 1e3 if isinstance(base, (int, float)) and math.isfinite(base) else 0.0
    return [float(t.facts["t0"]) + offset, float(t.facts["t_end"]) + offset]


def summarize(t: ParsedTrace, *, consecutive_kernel_delay_us: float = 30.0, tiny_kernel_us: float = 10.0,
              top_n: int = 10) -> dict[str, Any]:
    """Everything the rules, the reports and the charts need about one rank."""
    t0 = float(t.facts["t0"])
    gpu = has_gpu(t)
    bd = step_breakdown(t, consecutive_kernel_delay_us)
    dl = dataloader_per_step(t)
    sy = sync_per_step(t)
    calls = sync_calls(t)
    steps = t.steps.assign(start_ms=(t.steps["ts"] - t0) / 1e3, end_ms=(t.steps["end"] - t0) / 1e3)
    n_steps = len(steps)
    step_us_mean = float(bd["step_us"].mean())
    busy = not_waiting = None
    if gpu:
        busy = float((bd["computation_us"] + bd["memory_us"]).mean())
        # everything but exposed communication: how long the rank takes to reach its collectives (a rank slowed by
        # its host is idle longer, not busier)
        not_waiting = float((bd["step_us"] - bd["communication_us"]).mean())
    # totals count every call in the file, also those outside the step windows
    kinds = calls["kind"].value_counts()
    sync_totals = {k: int(kinds.get(k, 0)) for k in ("stream_sync", "device_sync", "event_sync", "item")}
    sync_totals["total"] = sum(sync_totals.values())
    first_calls = (calls.groupby("name")["ts_us"].apply(lambda s: [round(v / 1e3, 3) for v in s.head(3)]).to_dict())
    # the runtime's own call names of each kind (cudaStreamSynchronize, hipStreamSynchronize, ...): what titles name
    by_name = calls[calls["kind"] != "item"].groupby(["kind", "name"]).size()
    sync_names = {k: {str(n): int(c) for n, c in by_name[k].items()} for k in by_name.index.unique(level="kind")}
    return _clean({
        "path": t.path,
        "rank": t.rank,
        "world_size": t.world_size,
        "device": t.device_name,
        "device_kind": device_kind(t),
        "has_gpu": gpu,
        "warnings": list(t.warnings),
        "events": int(t.facts["events"]),
        "trace_start_us": t0,
        "window_us": clock_window(t),
        "steps": _records(steps[["step", "name", "start_ms", "end_ms", "dur"]].rename(columns={"dur": "dur_us"})),
        "n_steps": n_steps,
        "step_us_mean": step_us_mean,
        "busy_us_per_step": busy,
        "not_waiting_us_per_step": not_waiting,
        "breakdown": _records(bd),
        "fractions": mean_fractions(bd),
        "top_kernels": _records(top_kernels(t, top_n)),
        "launch": launch_stats(t, tiny_kernel_us),
        "memcpy": _records(memcpy_by_kind(t)),
        # every copy call of the trace; each memcpy row's "calls" are those that issued its copies
        "memcpy_calls": sorted(n for n in t.facts["cpu_names"] if MEMCPY_CALL_RE.match(n)),
        "overlap": comm_comp_overlap(t),
        "sync": {"per_step": _records(sy), "totals": sync_totals,
                 "per_step_mean": float(sy["total"].mean()) if len(sy) else 0.0,
                 "blocked_us_per_step": float(sy["blocked_us"].mean()) if len(sy) else 0.0,
                 "idle_after_us_per_step": float(sy["idle_after_us"].mean()) if len(sy) else 0.0,
                 "first_calls_ms": first_calls, "names": sync_names},
        "dataloader": {"per_step": _records(dl), "share": float(dl["dataloader_us"].sum() / bd["step_us"].sum())
                       if float(bd["step_us"].sum()) > 0 else 0.0,
                       "us_per_step": float(dl["dataloader_us"].mean()),
                       "device_idle_us_per_step": float(dl["device_idle_us"].mean()) if gpu else None},
        "tensor_cores": tensor_core_usage(t),
        "arithmetic": _arithmetic(t, bd, gpu),
    })


def _arithmetic(t: ParsedTrace, bd: pd.DataFrame, gpu: bool) -> dict[str, Any]:
    """Share of step time doing arithmetic: device busy time with a device, else the host's matmul/conv ops."""
    total = float(bd["step_us"].sum())
    if gpu:
        busy = float((bd["step_us"] - bd["idle_us"]).sum())
        return {"basis": "device", "share": busy / total if total > 0 else None,
                "us_per_step": busy / max(len(bd), 1),
                "ops_per_step": float(gpu_events(t)["kind"].eq("COMPUTATION").sum()) / max(len(bd), 1)}
    m = math_per_step(t)
    return {"basis": "host", "share": float(m["math_us"].sum()) / total if total > 0 else None,
            "us_per_step": float(m["math_us"].mean()) if len(m) else 0.0,
            "ops_per_step": float(m["math_ops"].mean()) if len(m) else 0.0}
