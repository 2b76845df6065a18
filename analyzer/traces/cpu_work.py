"""How much of each step is arithmetic: the model's matrix multiplies and convolutions, on the host or the device.

On a device the arithmetic is the device's busy time. On the host (a CPU-only trace) it is the time inside the
operators that do the arithmetic (aten::mm, addmm, bmm, convolution, ...); the rest of a step is per-step
overhead (Python, the dispatcher, autograd and optimizer bookkeeping, fetching the batch). Tiny steps are
mostly overhead.
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd

from analyzer.traces.events import clipped_total, merge_intervals, step_windows
from analyzer.traces.parse import ParsedTrace

MATH_OPS = re.compile(
    r"^aten::(mm|addmm|bmm|baddbmm|addbmm|addmv|mv|dot|_?convolution|mkldnn_convolution|_scaled_dot_product\w*)$"
)


def math_per_step(t: ParsedTrace) -> pd.DataFrame:
    """One row per step: step_us, math_us (union of arithmetic-operator time in the step), math_ops."""
    df = t.df
    cats = df["s_name"].cat.categories
    codes = [i for i, n in enumerate(cats) if MATH_OPS.match(str(n))]
    ops = df[df["stream"].lt(0) & df["s_name"].cat.codes.isin(codes) & df["dur"].gt(0)]
    w0, w1 = step_windows(t)
    s, e = merge_intervals(ops["ts"].to_numpy(float), ops["end"].to_numpy(float))
    starts = np.sort(ops["ts"].to_numpy(float))
    return pd.DataFrame({"step": t.steps["step"].to_numpy(), "step_us": w1 - w0,
                         "math_us": clipped_total(s, e, w0, w1),
                         "math_ops": np.searchsorted(starts, w1) - np.searchsorted(starts, w0)})
