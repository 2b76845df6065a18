"""Synchronisation calls per step: stream/device/event syncs and .item()-style reads of a GPU scalar.

One synchronisation is counted once. A device .item() runs aten::_local_scalar_dense inside it, and that runs the
device-to-host copy and the cudaStreamSynchronize that waits for it: the four calls are one wait, counted as one
.item(). An .item() of a CPU tensor (a Python float kept in a tensor) waits for nothing: on a trace with a device
timeline it is known by having neither a synchronising runtime call nor a device-to-host copy inside it, and is
not counted. Without a device timeline nothing tells the two apart, and every .item() counts.

While the CPU blocks in a synchronisation the device is busy: it works off the queue the CPU waits on. What a
synchronisation costs the device is what follows when the device drains that queue during the call: it then stands
idle until the CPU, released, launches again. That idle stretch (one that begins inside a synchronising call and
lasts past its return, counted once however many calls end in it) is each step's `idle_after_us`, unless a copy into
pageable host memory ends as it begins: that stretch is the copy's hidden sync, costed by analyzer.rules.pageable_dtoh.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from analyzer.traces.events import SYNC_NAMES, clipped_total, gpu_events, merge_intervals, step_windows
from analyzer.traces.parse import ParsedTrace

KINDS = ["stream_sync", "device_sync", "event_sync", "item"]
ITEM_KINDS = ("item", "local_scalar_dense")
COPY_CATS = ["gpu_memcpy", "Memcpy"]


def _inside(ts: np.ndarray, end: np.ndarray, x: np.ndarray) -> np.ndarray:
    """For each interval [ts, end] (sorted by ts, disjoint): whether any time of x falls in it."""
    if not len(x) or not len(ts):
        return np.zeros(len(ts), bool)
    x = np.sort(x)
    return np.searchsorted(x, end, side="right") > np.searchsorted(x, ts, side="left")


def _copies_named(g: pd.DataFrame, pattern: str) -> pd.DataFrame:
    """The device's copies whose name matches `pattern` (from its start). The copies are picked out first, and their
    names read as objects (the category's own strings): `astype(str)` on the category makes a string of every name
    the trace holds, which on a 300 MB trace took ~170 MiB more than the whole analysis otherwise does."""
    copies = g[g["s_cat"].isin(COPY_CATS)]
    return copies[copies["s_name"].astype(object).str.match(pattern).fillna(False).astype(bool)]


def _outermost(ts: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Positions (in ts order) of the intervals not inside an earlier-starting one: .item() holds
    _local_scalar_dense, and an .item() may sit inside another operator's .item()."""
    order = np.lexsort((-end, ts))  # an outer call first when two start together
    e = end[order]
    before = np.concatenate([[-np.inf], np.maximum.accumulate(e)[:-1]])
    return np.sort(order[e > before])


def sync_calls(t: ParsedTrace) -> pd.DataFrame:
    """Every synchronisation on the CPU, counted once: step, kind, name, ts (us from trace start), dur (us)."""
    df = t.df
    codes = {i: SYNC_NAMES[str(n)] for i, n in enumerate(df["s_name"].cat.categories) if str(n) in SYNC_NAMES}
    calls = df[df["s_name"].cat.codes.isin(list(codes)) & df["stream"].lt(0)]
    kind = calls["s_name"].cat.codes.map(codes).to_numpy().astype(object)
    ts, end = calls["ts"].to_numpy(float), calls["end"].to_numpy(float)
    is_item = np.isin(kind, ITEM_KINDS)
    items = np.flatnonzero(is_item)
    items = items[np.argsort(ts[items], kind="stable")]
    items = items[_outermost(ts[items], end[items])]
    syncs = np.flatnonzero(~is_item)
    g = gpu_events(t)
    keep_sync = np.ones(len(syncs), bool)
    if len(g):
        # the .item()s that waited for the device: a runtime sync or a device-to-host copy's launch inside them
        copies = _copies_named(g, r"Memcpy DtoH")
        waits = np.concatenate([ts[syncs], copies["launch_ts"].dropna().to_numpy(float)])
        items = items[_inside(ts[items], end[items], waits)]
        # a sync inside a device .item() is that .item()'s own wait
        if len(items):
            s_ts = ts[syncs]
            at = np.searchsorted(ts[items], s_ts, side="right") - 1
            keep_sync = ~((at >= 0) & (s_ts <= end[items][np.clip(at, 0, None)]))
    rows = np.sort(np.concatenate([items, syncs[keep_sync]]))
    kind[items] = "item"
    chosen = calls.iloc[rows]
    return pd.DataFrame({
        "step": chosen["iteration"].to_numpy(),
        "kind": kind[rows],
        "name": chosen["s_name"].astype(object).to_numpy(),
        "ts_us": (chosen["ts"] - t.facts["t0"]).to_numpy(),
        "dur_us": chosen["dur"].to_numpy(),
    }).sort_values("ts_us").reset_index(drop=True)


def _idle_after(t: ParsedTrace, calls: pd.DataFrame) -> np.ndarray:
    """Per step: the device's idle time (us) in the stretches that begin while a synchronising call blocks."""
    w0, w1 = step_windows(t)
    g = gpu_events(t)
    if g.empty or calls.empty:
        return np.zeros(len(w0))
    s, e = merge_intervals(g["ts"].to_numpy(float), g["end"].to_numpy(float))
    gap_start, gap_end = e[:-1], s[1:]  # every idle stretch between two busy ones
    if not len(gap_start):
        return np.zeros(len(w0))
    c0 = calls["ts_us"].to_numpy(float) + float(t.facts["t0"])
    c1 = c0 + calls["dur_us"].to_numpy(float)
    # the stretch the call returns in: it began during the call (not before: then the device was idle already, the
    # host's doing) and lasts past the return (else the device went on with other streams' work)
    at = np.clip(np.searchsorted(gap_start, c1, side="right") - 1, 0, None)
    hit = (gap_start[at] >= c0) & (gap_start[at] <= c1) & (gap_end[at] >= c1)
    # a stretch that begins as a copy into pageable memory ends is that copy's (the rule pageable_dtoh costs it): the
    # .item() or .cpu() that waits for such a copy is one wait, its cost counted once
    pageable = _copies_named(g, r"Memcpy DtoH.*Pageable")
    ends = np.sort(pageable["end"].to_numpy(float))
    k = np.clip(np.searchsorted(ends, gap_start[at] - 0.5), 0, max(len(ends) - 1, 0))
    if len(ends):
        hit &= np.abs(ends[k] - gap_start[at]) >= 0.5  # absolute: timestamps are ~1e12 us
    drained = np.unique(at[hit])
    return clipped_total(gap_start[drained], gap_end[drained], w0, w1)


def sync_per_step(t: ParsedTrace) -> pd.DataFrame:
    """One row per step: how many synchronisations of each kind, the CPU time they blocked (us), and the device's
    idle time after the ones it drained its queue in (us)."""
    calls = sync_calls(t)
    steps = t.steps[["step"]].copy()
    counts = calls.pivot_table(index="step", columns="kind", values="dur_us", aggfunc="size", fill_value=0)
    blocking = calls.groupby("step")["dur_us"].sum()
    out = steps.merge(counts, left_on="step", right_index=True, how="left").fillna(0)
    for kind in KINDS:
        if kind not in out:
            out[kind] = 0
        out[kind] = out[kind].astype(int)
    out["total"] = out[KINDS].sum(axis=1)
    out["blocked_us"] = out["step"].map(blocking).fillna(0.0)
    out["idle_after_us"] = _idle_after(t, calls)
    return out[["step", *KINDS, "total", "blocked_us", "idle_after_us"]]
