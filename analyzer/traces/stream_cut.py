"""What of a trace cut short (or corrupt part way) the streaming reader (analyzer.traces.stream_read) can still
analyse: the profiler steps before the cut none of whose events may be missing."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np
import pandas as pd

from analyzer.traces.parse import STEP_RE
from analyzer.traces.stream_fields import SPILL

GAP_IDS = 1000  # a wider gap between correlation ids read means calls are missing there


class ReadColumns(Protocol):
    """What the judgement needs of the read (analyzer.traces.stream_read.StreamedColumns, once its frame is built)."""

    gpu_corr: np.ndarray

    def spilled_chunks(self) -> Iterator[np.ndarray]: ...

    def _round(self, ts: np.ndarray, dur: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]: ...


def covered(cols: ReadColumns) -> list[tuple[float, float]]:
    """The stretches of time whose CPU calls with a correlation id were all read: the ids are given out one after
    another, so a run of ids read without a gap wider than GAP_IDS covers the time from its first to its last call
    (Kineto filters a few calls out, which leaves gaps of up to ~140 ids in whole traces)."""
    parts = [rec[["corr", "ts", "dur"]][rec["corr"] >= 0] for rec in cols.spilled_chunks()]
    rec = np.concatenate(parts) if parts else np.empty(0, SPILL)
    if not len(rec):
        return []
    rec = rec[np.argsort(rec["corr"], kind="stable")]
    ts, _, _ = cols._round(rec["ts"], rec["dur"])
    ts = ts.astype(np.float64)
    breaks = np.flatnonzero(np.diff(rec["corr"]) > GAP_IDS) + 1
    return [(float(part.min()), float(part.max())) for part in np.split(ts, breaks) if len(part)]


def complete_part(cols: ReadColumns, df: pd.DataFrame, meta: dict[str, Any]) -> tuple[pd.DataFrame, int] | None:
    """The events of the complete steps before a cut, with how many steps that is; None when no step is complete.

    Kineto writes the device's events and the launch calls as its activity buffers fill, not in time order (a
    ring: the ids may start mid-trace and wrap round), so the time of the last event read says nothing of what is
    missing. A step is complete when its whole window lies in a stretch whose CPU calls were all read (by
    correlation id, covered), no launch call in it lost its device event, and no device event from it or the step
    after lost its launch call. A trace that names a device but was cut before any device event has no complete
    step; a trace without device events is judged by its CPU calls alone."""
    cpu = df[df["stream"].lt(0)]
    steps = cpu[cpu["s_name"].astype(object).str.match(STEP_RE.pattern)
                & cpu["s_cat"].isin(["user_annotation", "cpu_op"])].sort_values("ts")
    gpu = df[df["stream"].ge(0)]
    if steps.empty or (meta.get("deviceProperties") and gpu.empty):
        return None
    w0, w1 = steps["ts"].to_numpy(float), steps["end"].to_numpy(float)
    unsure: list[tuple[float, float]] = []  # stretches of time whose events may be missing
    if len(gpu):
        lag = (gpu["ts"] - gpu["launch_ts"]).max()  # a device event runs at most this long after its launch
        lag = float(lag) if np.isfinite(lag) else 0.0
        spans = sorted(covered(cols))
        edges = [-math.inf, *[x for span in spans for x in span], math.inf]
        # launch calls may be missing between the stretches read; their device events ran up to `lag` later
        unsure += [(a, b + lag) for a, b in zip(edges[::2], edges[1::2], strict=True)]
        seen = np.unique(cols.gpu_corr)
        for rec in cols.spilled_chunks():
            rec = rec[(rec["launch"] == 1) & (rec["corr"] >= 0)]
            lost = ~np.isin(rec["corr"], seen, kind="sort")
            ts, _, _ = cols._round(rec["ts"][lost], rec["dur"][lost])
            unsure += [(t, t + lag) for t in np.asarray(ts, float)]  # its device event is missing
        # the device rows keep their file order, as the correlation ids beside the frame do
        orphan = gpu[(cols.gpu_corr >= 0) & gpu["launch_ts"].isna().to_numpy()]
        unsure += [(t - lag, t) for t in orphan["ts"].to_numpy(float)]  # its launch call is missing
    ok = np.array([not any(a < e and s < b for a, b in unsure) for s, e in zip(w0, w1, strict=True)], bool)
    if not ok.any():
        return None
    # every event read stays (a complete step's idle time depends on the busy stretch before it); the incomplete
    # steps' own spans go, so that they are no steps of the analysis
    return df.drop(index=steps.index[~ok]).reset_index(drop=True), int(ok.sum())
