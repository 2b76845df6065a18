"""Vectorised building blocks the detectors share: per (workflow, device) statistics and runs of samples."""

from __future__ import annotations

import math

import pandas as pd

from analyzer.telemetry.frame import TelemetryWindow
from analyzer.telemetry.thresholds import GIB

KEYS = ["workflow_id", "device_id"]


def held_stats(window: TelemetryWindow) -> pd.DataFrame:
    """Per (workflow, device) over the samples where the workflow held the device.

    Columns: held_s (wall seconds held), gpu_s (held seconds x share of the device), util_mean,
    util_p95, sm_active_mean, sm_samples, mem_peak, mem_total, first_ts, last_ts.
    """
    if "held_stats" in window.cache:
        return window.cache["held_stats"]
    held = window.usage[window.usage["held"]].copy()
    if held.empty:
        stats = pd.DataFrame(columns=["held_s", "gpu_s", "util_mean", "util_p95", "sm_active_mean", "sm_samples",
                                      "mem_peak", "mem_total", "first_ts", "last_ts"],
                             index=pd.MultiIndex.from_arrays([[], []], names=KEYS))
    else:
        held["gpu_s"] = held["dt"] * held["share"]
        held["end_ts"] = held["ts"] + held["dt"]
        g = held.groupby(KEYS, sort=False)
        stats = g.agg(
            held_s=("dt", "sum"), gpu_s=("gpu_s", "sum"), util_mean=("gpu_util", "mean"),
            sm_active_mean=("sm_active", "mean"), sm_samples=("sm_active", "count"), mem_peak=("wf_mem", "max"),
            mem_total=("mem_total", "max"), first_ts=("ts", "min"), last_ts=("end_ts", "max"),
        )
        stats["util_p95"] = g["gpu_util"].quantile(0.95)
    window.cache["held_stats"] = stats
    return stats


def runs(frame: pd.DataFrame, flag: pd.Series, keys: list[str]) -> pd.DataFrame:
    """Contiguous runs of flagged samples per key, sorted by (keys, ts).

    A run breaks at an unflagged sample, at a new key, or at a gap longer than the earlier sample's dt
    (plus a second of slack). Returns one row per run: keys, start, end, duration_s, samples,
    util_mean, mem_max (when those columns exist).
    """
    if frame.empty or not flag.any():
        return pd.DataFrame(columns=[*keys, "start", "end", "duration_s", "samples"])
    f = frame.assign(_flag=flag.to_numpy())
    same_key = pd.Series(True, index=f.index)
    for k in keys:
        same_key &= f[k].eq(f[k].shift())
    contiguous = (f["ts"] - f["ts"].shift()) <= f["dt"].shift() + 1.0
    continues = f["_flag"] & f["_flag"].shift(fill_value=False) & same_key & contiguous
    f["_run"] = (~continues).cumsum()
    f = f[f["_flag"]]
    f = f.assign(_end=f["ts"] + f["dt"])
    agg = {"start": ("ts", "min"), "end": ("_end", "max"), "duration_s": ("dt", "sum"), "samples": ("ts", "size")}
    if "gpu_util" in f:
        agg["util_mean"] = ("gpu_util", "mean")
    if "wf_mem" in f:
        agg["mem_max"] = ("wf_mem", "max")
    elif "mem_used" in f:
        agg["mem_max"] = ("mem_used", "max")
    out = f.groupby([*keys, "_run"], sort=False).agg(**agg).reset_index().drop(columns="_run")
    return out


def gib(n_bytes: float | None) -> float | None:
    return None if n_bytes is None or pd.isna(n_bytes) else round(float(n_bytes) / GIB, 2)


def lane_gib(peak_bytes: float, headroom: float) -> int:
    """The lane a job of this peak needs: peak plus Salus's headroom, in whole GiB (at least 1)."""
    return max(1, math.ceil(float(peak_bytes) * headroom / GIB))


def num(x: float | None, digits: int = 3) -> float | None:
    """A JSON-safe rounded float (None for missing)."""
    return None if x is None or pd.isna(x) else round(float(x), digits)
