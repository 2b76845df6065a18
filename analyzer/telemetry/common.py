"""Building blocks the detectors share: runs of samples, and units for their findings."""

from __future__ import annotations

import math

import pandas as pd

from analyzer.telemetry.thresholds import GIB
from store.headroom import LANE_HEADROOM

KEYS = ["workflow_id", "device_id"]


def runs(frame: pd.DataFrame, flag: pd.Series, keys: list[str]) -> pd.DataFrame:
    """Contiguous runs of flagged samples per key, sorted by (keys, ts).

    A run breaks at an unflagged sample, at a new key, or at a gap longer than the earlier sample's dt
    (plus a second of slack). Returns one row per run: keys, start, last (its last sample's time), end,
    duration_s, samples, util_mean, mem_max (when those columns exist).
    """
    if frame.empty or not flag.any():
        return pd.DataFrame(columns=[*keys, "start", "last", "end", "duration_s", "samples"])
    f = frame.assign(_flag=flag.to_numpy())
    same_key = pd.Series(True, index=f.index)
    for k in keys:
        same_key &= f[k].eq(f[k].shift())
    contiguous = (f["ts"] - f["ts"].shift()) <= f["dt"].shift() + 1.0
    continues = f["_flag"] & f["_flag"].shift(fill_value=False) & same_key & contiguous
    f["_run"] = (~continues).cumsum()
    f = f[f["_flag"]]
    f = f.assign(_end=f["ts"] + f["dt"])
    agg = {"start": ("ts", "min"), "last": ("ts", "max"), "end": ("_end", "max"), "duration_s": ("dt", "sum"),
           "samples": ("ts", "size")}
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


def lane_gib(peak_bytes: float) -> int:
    """The lane a job of this peak needs: peak plus Salus's headroom (store.headroom), in whole GiB (at least 1)."""
    return max(1, math.ceil(round(float(peak_bytes) * LANE_HEADROOM / GIB, 9)))


def num(x: float | None, digits: int = 3) -> float | None:
    """A JSON-safe rounded float (None for missing)."""
    return None if x is None or pd.isna(x) else round(float(x), digits)
