"""Device time in profiler traces of lane-mates: each job's kernel spans on the host's clock, and how much of two
jobs' kernel time overlapped (a time-sliced lane's target is none)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from analyzer.traces.events import gpu_events, merge_intervals, union_length
from analyzer.traces.parse import parse_trace

KERNEL_CATS = ("kernel", "Kernel")


def kernel_spans(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """(starts, ends) in microseconds on the host's wall clock of the trace's kernels, merged where they touch.

    Kineto writes event times from its own base (`baseTimeNanoseconds`, when present); adding it puts two
    processes' traces on one clock so their kernels can be compared."""
    parsed = parse_trace(path)
    g = gpu_events(parsed)
    g = g[g["s_cat"].isin(KERNEL_CATS)]
    base_us = float(parsed.meta.get("baseTimeNanoseconds") or 0) / 1000.0
    return merge_intervals(g["ts"].to_numpy(dtype=np.float64) + base_us, g["end"].to_numpy(dtype=np.float64) + base_us)


def overlap_us(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> float:
    """Microseconds during which kernels of both span sets ran (each set merged, as kernel_spans returns)."""
    (a0, a1), (b0, b1) = a, b
    if not len(a0) or not len(b0):
        return 0.0
    # |A ∩ B| = |A| + |B| - |A ∪ B|
    union = union_length(np.concatenate([a0, b0]), np.concatenate([a1, b1]))
    return max(0.0, float((a1 - a0).sum() + (b1 - b0).sum()) - union)


def overlap_fraction(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> float:
    """The overlap as a fraction of the smaller job's kernel time (0: the lane held; 1: fully concurrent)."""
    smaller = min(float((a[1] - a[0]).sum()), float((b[1] - b[0]).sum()))
    return overlap_us(a, b) / smaller if smaller > 0 else 0.0
