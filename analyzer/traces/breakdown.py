"""Time per step split into computation, communication, memory copies and idle; idle split by its cause.

Same definitions as HTA's temporal and idle-time breakdowns (kernel kinds from `hta.utils.get_kernel_type`;
host wait = the next kernel was launched after the GPU went idle; kernel wait = a gap shorter than the
back-to-back launch delay), but over the whole device rather than per stream, and per step window so the
parts add up to the step's wall time: computation wins over communication, which wins over memory.
CPU-only traces get the step times with every GPU part left as None.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from analyzer.traces.events import clipped_total, gpu_events, merge_intervals, step_windows
from analyzer.traces.parse import ParsedTrace

COLUMNS = ["step", "step_us", "computation_us", "communication_us", "memory_us", "idle_us",
           "host_wait_us", "kernel_wait_us", "other_idle_us"]


def _union_in_windows(ev: pd.DataFrame, w0: np.ndarray, w1: np.ndarray) -> np.ndarray:
    s, e = merge_intervals(ev["ts"].to_numpy(float), ev["end"].to_numpy(float))
    return clipped_total(s, e, w0, w1)


def _idle_gaps(t: ParsedTrace, g: pd.DataFrame, consecutive_kernel_delay_us: float) -> pd.DataFrame:
    """Every stretch with nothing running on the device, and why (the kernel that ends it decides)."""
    order = g.sort_values("ts")
    s, e = order["ts"].to_numpy(float), order["end"].to_numpy(float)
    run_end = np.maximum.accumulate(e)
    new = np.empty(len(s), bool)
    new[0] = True
    new[1:] = s[1:] > run_end[:-1]
    first = order[new]  # the kernel that starts each busy interval
    gap_start = np.concatenate([[-np.inf], run_end[np.flatnonzero(new)[1:] - 1]])
    gap_end = first["ts"].to_numpy(float)
    # when the CPU launched the kernel that ends the gap (HTA's "ts_runtime")
    runtime_ts = first["launch_ts"].to_numpy(float)
    cause = np.where(
        runtime_ts > gap_start, "host_wait",
        np.where(gap_end - gap_start < consecutive_kernel_delay_us, "kernel_wait", "other_idle"),
    )
    cause[0] = "other_idle"  # before the first kernel
    gaps = pd.DataFrame({"start": gap_start, "end": gap_end, "cause": cause})
    tail = pd.DataFrame({"start": [run_end[-1]], "end": [np.inf], "cause": ["other_idle"]})
    return pd.concat([gaps, tail], ignore_index=True)


def step_breakdown(t: ParsedTrace, consecutive_kernel_delay_us: float = 30.0) -> pd.DataFrame:
    """One row per step: wall time and its parts in microseconds (they sum to step_us)."""
    w0, w1 = step_windows(t)
    out = pd.DataFrame({"step": t.steps["step"].to_numpy(), "step_us": w1 - w0})
    g = gpu_events(t)
    if g.empty:
        for col in COLUMNS[2:]:
            out[col] = None
        return out
    comp = _union_in_windows(g[g["kind"].eq("COMPUTATION")], w0, w1)
    comp_comm = _union_in_windows(g[g["kind"].isin(["COMPUTATION", "COMMUNICATION"])], w0, w1)
    busy = _union_in_windows(g, w0, w1)
    out["computation_us"] = comp
    out["communication_us"] = comp_comm - comp
    out["memory_us"] = busy - comp_comm
    out["idle_us"] = (w1 - w0) - busy
    gaps = _idle_gaps(t, g, consecutive_kernel_delay_us)
    lo, hi = min(float(w0.min()), float(g["ts"].min())), max(float(w1.max()), float(g["end"].max()))
    for cause in ("host_wait", "kernel_wait", "other_idle"):
        part = gaps[gaps["cause"].eq(cause)]
        # finite bounds: the cumulative sums in clipped_total must not mix in infinities
        starts = np.clip(part["start"].to_numpy(float), lo, hi)
        ends = np.clip(part["end"].to_numpy(float), lo, hi)
        out[f"{cause}_us"] = clipped_total(starts, ends, w0, w1)
    return out


def mean_fractions(bd: pd.DataFrame) -> dict[str, float | None]:
    """Each part's share of total step time over all steps."""
    total = float(bd["step_us"].sum())
    res: dict[str, float | None] = {}
    for col in COLUMNS[2:]:
        vals = bd[col]
        res[col.removesuffix("_us")] = None if vals.isna().all() or total <= 0 else float(vals.sum()) / total
    return res
