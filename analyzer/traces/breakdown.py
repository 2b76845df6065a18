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


def _union_in_windows(g: pd.DataFrame, mask: np.ndarray | None, w0: np.ndarray, w1: np.ndarray) -> np.ndarray:
    ts, end = g["ts"].to_numpy(float), g["end"].to_numpy(float)
    s, e = merge_intervals(ts, end) if mask is None else merge_intervals(ts[mask], end[mask])
    return clipped_total(s, e, w0, w1)


CAUSES = ("host_wait", "kernel_wait", "other_idle")


def _idle_gaps(g: pd.DataFrame, consecutive_kernel_delay_us: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every stretch with nothing running on the device, and why (the kernel that ends it decides): start, end and
    cause (an index into CAUSES) arrays, on whole columns (a large trace has millions of device events)."""
    s, e = g["ts"].to_numpy(float), g["end"].to_numpy(float)  # gpu_events come in time order: no copies
    run_end = np.maximum.accumulate(e)
    new = np.empty(len(s), bool)
    new[0] = True
    new[1:] = s[1:] > run_end[:-1]
    first = np.flatnonzero(new)  # the kernel that starts each busy interval
    gap_start = np.concatenate([[-np.inf], run_end[first[1:] - 1]])
    gap_end = s[first]
    # when the CPU launched the kernel that ends the gap (HTA's "ts_runtime")
    runtime_ts = g["launch_ts"].to_numpy(float)[first]
    cause = np.where(runtime_ts > gap_start, 0, np.where(gap_end - gap_start < consecutive_kernel_delay_us, 1, 2))
    cause[0] = 2  # before the first kernel
    return (np.append(gap_start, run_end[-1]), np.append(gap_end, np.inf), np.append(cause, 2))


def step_breakdown(t: ParsedTrace, consecutive_kernel_delay_us: float = 30.0) -> pd.DataFrame:
    """One row per step: wall time and its parts in microseconds (they sum to step_us)."""
    w0, w1 = step_windows(t)
    out = pd.DataFrame({"step": t.steps["step"].to_numpy(), "step_us": w1 - w0})
    g = gpu_events(t)
    if g.empty:
        for col in COLUMNS[2:]:
            out[col] = None
        return out
    comp = _union_in_windows(g, g["kind"].eq("COMPUTATION").to_numpy(), w0, w1)
    comp_comm = _union_in_windows(g, g["kind"].isin(["COMPUTATION", "COMMUNICATION"]).to_numpy(), w0, w1)
    busy = _union_in_windows(g, None, w0, w1)
    out["computation_us"] = comp
    out["communication_us"] = comp_comm - comp
    out["memory_us"] = busy - comp_comm
    out["idle_us"] = (w1 - w0) - busy
    gap_start, gap_end, gap_cause = _idle_gaps(g, consecutive_kernel_delay_us)
    lo, hi = min(float(w0.min()), float(g["ts"].min())), max(float(w1.max()), float(g["end"].max()))
    for i, cause in enumerate(CAUSES):
        part = gap_cause == i
        # finite bounds: the cumulative sums in clipped_total must not mix in infinities
        starts = np.clip(gap_start[part], lo, hi)
        ends = np.clip(gap_end[part], lo, hi)
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
