"""Synchronisation calls per step: stream/device/event syncs and .item()-style reads of a GPU scalar."""

from __future__ import annotations

import pandas as pd

from analyzer.traces.events import SYNC_NAMES
from analyzer.traces.parse import ParsedTrace

KINDS = ["stream_sync", "device_sync", "event_sync", "item", "local_scalar_dense"]


def sync_calls(t: ParsedTrace) -> pd.DataFrame:
    """Every synchronising CPU call: step, kind, name, ts (us from trace start), dur (us)."""
    df = t.df
    codes = {i: SYNC_NAMES[str(n)] for i, n in enumerate(df["s_name"].cat.categories) if str(n) in SYNC_NAMES}
    calls = df[df["s_name"].cat.codes.isin(list(codes)) & df["stream"].lt(0)]
    return pd.DataFrame({
        "step": calls["iteration"].to_numpy(),
        "kind": calls["s_name"].cat.codes.map(codes).to_numpy(),
        "name": calls["s_name"].astype(object).to_numpy(),
        "ts_us": (calls["ts"] - t.facts["t0"]).to_numpy(),
        "dur_us": calls["dur"].to_numpy(),
    }).sort_values("ts_us").reset_index(drop=True)


def sync_per_step(t: ParsedTrace) -> pd.DataFrame:
    """One row per step: how many calls of each kind, and the CPU time they blocked (us)."""
    calls = sync_calls(t)
    steps = t.steps[["step"]].copy()
    counts = calls.pivot_table(index="step", columns="kind", values="dur_us", aggfunc="size", fill_value=0)
    # .item() runs _local_scalar_dense inside it: count the outer call, block time once
    blocking = calls[calls["kind"].ne("local_scalar_dense")].groupby("step")["dur_us"].sum()
    out = steps.merge(counts, left_on="step", right_index=True, how="left").fillna(0)
    for kind in KINDS:
        if kind not in out:
            out[kind] = 0
        out[kind] = out[kind].astype(int)
    out["item"] = out[["item", "local_scalar_dense"]].max(axis=1)
    out["total"] = out[["stream_sync", "device_sync", "event_sync", "item"]].sum(axis=1)
    out["blocked_us"] = out["step"].map(blocking).fillna(0.0)
    return out[["step", *KINDS, "total", "blocked_us"]]
