"""GPU kernels: the top kernels by time, launch statistics, and the share of GPU time on tensor cores."""

from __future__ import annotations

import numpy as np
import pandas as pd

from analyzer.traces.events import clipped_total, gpu_events, merge_intervals, step_windows
from analyzer.traces.names import MATMUL_RE, NOT_TENSOR_CORE_RE, TENSOR_CORE_RE
from analyzer.traces.parse import ParsedTrace


def _kernels(t: ParsedTrace) -> pd.DataFrame:
    g = gpu_events(t)
    return g[g["s_cat"].isin(["kernel", "Kernel"])]


def top_kernels(t: ParsedTrace, n: int = 10) -> pd.DataFrame:
    """Kernels grouped by name: count, total/mean/max time (us), kind and share of all kernel time."""
    k = _kernels(t)
    cols = ["name", "kind", "count", "total_us", "mean_us", "max_us", "share"]
    if k.empty:
        return pd.DataFrame(columns=cols)
    grouped = (
        k.groupby("s_name", observed=True)
        .agg(kind=("kind", "first"), count=("dur", "size"), total_us=("dur", "sum"), mean_us=("dur", "mean"),
             max_us=("dur", "max"))
        .reset_index()
    )
    grouped["name"] = grouped["s_name"].astype(object)
    # ties broken by name: the symbol codes follow a set's order, which changes from one process to the next
    grouped = grouped.sort_values(["total_us", "name"], ascending=[False, True], kind="mergesort")
    grouped["share"] = grouped["total_us"] / float(k["dur"].sum())
    return grouped.head(n)[cols].reset_index(drop=True)


def launch_stats(t: ParsedTrace, tiny_kernel_us: float = 10.0) -> dict:
    """How kernels were launched: counts per step, CPU launch cost, launch-to-start delay, tiny kernels."""
    k = _kernels(t)
    steps = max(len(t.steps), 1)
    calls, cpu_us = t.facts["launch_calls"], t.facts["launch_us"]  # every launch call, also those without a kernel
    # per step: the kernels that start inside a step (not those still running after the last one ends)
    w0, w1 = merge_intervals(*step_windows(t))
    starts = k["ts"].to_numpy(float)
    at = np.searchsorted(w0, starts, side="right") - 1
    in_steps = (at >= 0) & (starts < w1[np.clip(at, 0, None)]) if len(w0) else np.zeros(len(k), bool)
    tiny = k["dur"].lt(tiny_kernel_us).to_numpy()
    res = {
        "kernels": int(len(k)),
        "kernels_per_step": float(in_steps.sum()) / steps,
        "launch_calls": int(calls),
        "launch_cpu_mean_us": cpu_us / calls if calls else None,
        "launch_cpu_total_us": float(cpu_us),
        "tiny_kernel_us": tiny_kernel_us,
        "tiny_kernels": int(k["dur"].lt(tiny_kernel_us).sum()) if len(k) else 0,
        "tiny_kernels_per_step": float((tiny & in_steps).sum()) / steps,
        "tiny_share": float(k["dur"].lt(tiny_kernel_us).mean()) if len(k) else 0.0,
        "kernel_mean_us": float(k["dur"].mean()) if len(k) else None,
        "kernel_median_us": float(k["dur"].median()) if len(k) else None,
        "launch_delay_mean_us": None,
        "launch_delay_p95_us": None,
        "launch_names": list(t.facts["launch_names"]),
    }
    if len(k):
        linked = k[k["launch_ts"].notna()]
        delay = linked["ts"].to_numpy(float) - linked["launch_ts"].to_numpy(float)
        delay = delay[~np.isnan(delay)]
        if len(delay):
            res["launch_delay_mean_us"] = float(delay.mean())
            res["launch_delay_p95_us"] = float(np.percentile(delay, 95))
    return res


def tensor_core_usage(t: ParsedTrace) -> dict:
    """Share of computation time in tensor-core kernels, and in matmul/conv kernels that do not use them."""
    g = gpu_events(t)
    comp = g[g["kind"].eq("COMPUTATION") & g["s_cat"].isin(["kernel", "Kernel"])]
    if comp.empty:
        return {"computation_us": 0.0, "tensor_core_us": 0.0, "tensor_core_share": None, "matmul_us": 0.0,
                "matmul_share": None, "matmul_without_tensor_cores_us": 0.0,
                "matmul_without_tensor_cores_wall_us": 0.0, "top_non_tc_matmul": []}
    cats = comp["s_name"].astype("category").cat.remove_unused_categories()
    is_tc = cats.map({n: bool(TENSOR_CORE_RE.search(str(n))) and not NOT_TENSOR_CORE_RE.search(str(n))
                      for n in cats.cat.categories}).astype(bool)
    is_mm = cats.map({n: bool(MATMUL_RE.search(str(n))) for n in cats.cat.categories}).astype(bool)
    total = float(comp["dur"].sum())
    non_tc_mm = comp[is_mm & ~is_tc]
    top = (non_tc_mm.assign(name=non_tc_mm["s_name"].astype(object)).groupby("name")["dur"].sum()
           .sort_values(ascending=False).head(5))
    # the wall time those kernels take inside the steps: kernels running side by side on several streams count once
    w0, w1 = merge_intervals(*step_windows(t))
    ws, we = merge_intervals(non_tc_mm["ts"].to_numpy(float), non_tc_mm["end"].to_numpy(float))
    return {
        "computation_us": total,
        "tensor_core_us": float(comp.loc[is_tc, "dur"].sum()),
        "tensor_core_share": float(comp.loc[is_tc, "dur"].sum()) / total if total else None,
        "matmul_us": float(comp.loc[is_mm, "dur"].sum()),
        "matmul_share": float(comp.loc[is_mm, "dur"].sum()) / total if total else None,
        "matmul_without_tensor_cores_us": float(non_tc_mm["dur"].sum()),
        "matmul_without_tensor_cores_wall_us": float(clipped_total(ws, we, w0, w1).sum()),
        "top_non_tc_matmul": [{"name": n, "total_us": float(v)} for n, v in top.items()],
    }
