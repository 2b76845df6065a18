"""The DataLoader's share of step time: `enumerate(DataLoader)#...__next__` spans inside each step."""

from __future__ import annotations

import re

import numpy as np
import pandas as pd

from analyzer.traces.events import clipped_total, merge_intervals, step_windows
from analyzer.traces.parse import ParsedTrace

DATALOADER_RE = re.compile(r"enumerate\(DataLoader\)|DataLoader.*__next__|_DataLoaderIter")


def dataloader_per_step(t: ParsedTrace) -> pd.DataFrame:
    """One row per step: DataLoader time (us), calls, and share of the step's wall time."""
    df = t.df
    codes = [i for i, n in enumerate(df["s_name"].cat.categories) if DATALOADER_RE.search(str(n))]
    spans = df[df["s_name"].cat.codes.isin(codes) & df["stream"].lt(0)]
    w0, w1 = step_windows(t)
    s, e = merge_intervals(spans["ts"].to_numpy(float), spans["end"].to_numpy(float))
    inside = clipped_total(s, e, w0, w1)
    calls = np.array([int(((spans["ts"] >= a) & (spans["ts"] < b)).sum()) for a, b in zip(w0, w1, strict=True)])
    return pd.DataFrame({"step": t.steps["step"].to_numpy(), "dataloader_us": inside, "calls": calls,
                         "share": np.where(w1 > w0, inside / np.where(w1 > w0, w1 - w0, 1), 0.0)})
