"""The DataLoader's share of step time: `enumerate(DataLoader)#...__next__` spans inside each step.

With a device timeline, what waiting for a batch costs the device is the time it stands idle during those spans
(`device_idle_us`): while the host fetches the next batch the device may still be working off the queued steps
(that is what prefetching buys). Without one (a CPU-only trace) it is None: the host's time is the cost.
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd

from analyzer.traces.events import clipped_total, gpu_events, merge_intervals, step_windows
from analyzer.traces.parse import ParsedTrace

DATALOADER_RE = re.compile(r"enumerate\(DataLoader\)|DataLoader.*__next__|_DataLoaderIter")


def dataloader_per_step(t: ParsedTrace) -> pd.DataFrame:
    """One row per step: DataLoader time (us), calls, share of the step's wall time, and the device's idle time
    during it (us; None without device events)."""
    df = t.df
    codes = [i for i, n in enumerate(df["s_name"].cat.categories) if DATALOADER_RE.search(str(n))]
    spans = df[df["s_name"].cat.codes.isin(codes) & df["stream"].lt(0)]
    w0, w1 = step_windows(t)
    s, e = merge_intervals(spans["ts"].to_numpy(float), spans["end"].to_numpy(float))
    inside = clipped_total(s, e, w0, w1)
    calls = np.array([int(((spans["ts"] >= a) & (spans["ts"] < b)).sum()) for a, b in zip(w0, w1, strict=True)])
    out = pd.DataFrame({"step": t.steps["step"].to_numpy(), "dataloader_us": inside, "calls": calls,
                        "share": np.where(w1 > w0, inside / np.where(w1 > w0, w1 - w0, 1), 0.0)})
    g = gpu_events(t)
    if g.empty:
        out["device_idle_us"] = None
        return out
    bs, be = merge_intervals(g["ts"].to_numpy(float), g["end"].to_numpy(float))
    us, ue = merge_intervals(np.concatenate([s, bs]), np.concatenate([e, be]))
    # |loader ∩ busy| = |loader| + |busy| - |loader ∪ busy|, per window
    both = inside + clipped_total(bs, be, w0, w1) - clipped_total(us, ue, w0, w1)
    out["device_idle_us"] = np.clip(inside - both, 0.0, None)
    return out
