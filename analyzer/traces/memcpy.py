"""Memory copies by direction (HtoD, DtoH, DtoD, ...) and host memory kind (pageable, pinned), with bandwidth."""

from __future__ import annotations

import re

import pandas as pd

from analyzer.traces.parse import ParsedTrace

# Kineto names copies "Memcpy HtoD (Pageable -> Device)"; ROCm says "Host" where CUDA says Pageable/Pinned
MEMCPY_RE = re.compile(r"^Memcpy\s+(\w+)\s*(?:\((\w+)\s*->\s*(\w+)\))?")
COLUMNS = ["direction", "host_memory", "count", "bytes", "total_us", "bandwidth_gbps", "first_ts_us"]


def _host_memory(direction: str, src: str | None, dst: str | None) -> str:
    ends = {x for x in (src, dst) if x and x != "Device"}
    for kind in ("Pageable", "Pinned", "Managed", "Host"):
        if kind in ends:
            return kind.lower()
    return "device" if direction == "DtoD" else "unknown"


def memcpy_by_kind(t: ParsedTrace) -> pd.DataFrame:
    """One row per (direction, host memory kind): copies, bytes, time (us), bandwidth (GB/s)."""
    df = t.df
    cp = df[df["stream"].ge(0) & df["s_cat"].isin(["gpu_memcpy", "Memcpy"])]
    if cp.empty:
        return pd.DataFrame(columns=COLUMNS)
    parts = cp["s_name"].astype(str).str.extract(MEMCPY_RE)
    parts.columns = ["direction", "src", "dst"]
    parts["direction"] = parts["direction"].fillna("unknown")
    host = [_host_memory(d, s if isinstance(s, str) else None, x if isinstance(x, str) else None)
            for d, s, x in parts.itertuples(index=False)]
    nbytes = cp["bytes"].clip(lower=0) if "bytes" in cp else pd.Series(0, index=cp.index)
    frame = pd.DataFrame({"direction": parts["direction"], "host_memory": host, "bytes": nbytes,
                          "dur": cp["dur"], "ts": cp["ts"] - t.df["ts"].min()})
    out = (frame.groupby(["direction", "host_memory"])
           .agg(count=("dur", "size"), bytes=("bytes", "sum"), total_us=("dur", "sum"), first_ts_us=("ts", "min"))
           .reset_index())
    # bytes per microsecond is MB/s; /1e3 gives GB/s
    out["bandwidth_gbps"] = out["bytes"] / out["total_us"].where(out["total_us"] > 0) / 1e3
    out.loc[out["bytes"] <= 0, "bandwidth_gbps"] = None  # the trace did not record sizes (ROCm)
    return out[COLUMNS].sort_values("total_us", ascending=False).reset_index(drop=True)
