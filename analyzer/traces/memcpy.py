"""Memory copies by direction (HtoD, DtoH, DtoD, ...) and host memory kind (pageable, pinned), with bandwidth."""

from __future__ import annotations

import re

import numpy as np
import pandas as pd

from analyzer.traces.events import clipped_total, covered_until, gpu_events, merge_intervals, step_windows
from analyzer.traces.names import COPY_CATS
from analyzer.traces.parse import ParsedTrace

# Kineto names copies "Memcpy HtoD (Pageable -> Device)"; ROCm says "Host" where CUDA says Pageable/Pinned. A memory
# kind may be two words: CUPTI's "Device Static" (a __device__ variable: cudaMemcpyToSymbol / FromSymbol) and
# "Managed Static" (a __managed__ variable)
MEMCPY_RE = re.compile(r"^Memcpy\s+(\w+)\s*(?:\(\s*([^()]+?)\s*->\s*([^()]+?)\s*\))?")
# the host memory each kind names; the device's own kinds (Device, Device Static, Array) name none
HOST_KINDS = {"Pageable": "pageable", "Pinned": "pinned", "Managed": "managed", "Managed Static": "managed",
              "Host": "host"}
# calls: the copy calls that issued this kind's copies (by correlation id), None when its copies carry no ids
COLUMNS = ["direction", "host_memory", "count", "bytes", "total_us", "bandwidth_gbps", "first_ts_us", "cpu_call_us",
           "idle_after_us", "in_steps_us", "calls"]


def _host_memory(direction: str, src: str | None, dst: str | None) -> str:
    ends = {HOST_KINDS[x] for x in (src, dst) if x in HOST_KINDS}
    for kind in ("pageable", "pinned", "managed", "host"):
        if kind in ends:
            return kind
    return "device" if direction == "DtoD" else "unknown"


def _idle_after(t: ParsedTrace, ends: np.ndarray) -> np.ndarray:
    """For each copy ending at `ends`: how long the device then stays idle inside the steps, when the copy ends its
    busy stretch (a copy that blocks the CPU drains the queue: the device waits until the CPU launches again)."""
    g = gpu_events(t)
    s, e = merge_intervals(g["ts"].to_numpy(float), g["end"].to_numpy(float))
    if len(s) == 0:
        return np.zeros(len(ends))
    k = np.clip(np.searchsorted(s, ends, side="right") - 1, 0, len(s) - 1)
    last_of_run = (np.abs(e[k] - ends) < 0.5) & (k + 1 < len(s))  # absolute: timestamps are ~1e12 us
    # only the idle time inside the steps: the cost is a share of step time
    w0, w1 = merge_intervals(*step_windows(t))
    nxt = s[np.clip(k + 1, 0, len(s) - 1)]
    gap = covered_until(w0, w1, nxt) - covered_until(w0, w1, e[k])
    return np.where(last_of_run, np.clip(gap, 0.0, None), 0.0)


def _calls(t: ParsedTrace, names: pd.Series, direction: pd.Series, host: list[str], out: pd.DataFrame
           ) -> list[list[str] | None]:
    """For each row of `out`: the copy calls that issued its kind's copies (t.facts["copy_calls"], by correlation
    id), None when none of them carries an id (or the trace was read before the calls were joined)."""
    by_name = t.facts.get("copy_calls")
    kinds = pd.DataFrame({"name": names.to_numpy(), "direction": direction.to_numpy(), "host": host})
    kinds = kinds.drop_duplicates()
    result: list[list[str] | None] = []
    for d, h in zip(out["direction"], out["host_memory"], strict=True):
        named = [by_name[n] for n in kinds.loc[(kinds["direction"] == d) & (kinds["host"] == h), "name"]
                 if by_name is not None and n in by_name]
        result.append(sorted({c for calls in named for c in calls}) if named else None)
    return result


def memcpy_by_kind(t: ParsedTrace) -> pd.DataFrame:
    """One row per (direction, host memory kind): copies, bytes, time (us), bandwidth (GB/s)."""
    df = t.df
    cp = df[df["stream"].ge(0) & df["s_cat"].isin(COPY_CATS)]
    if cp.empty:
        return pd.DataFrame(columns=COLUMNS)
    parts = cp["s_name"].astype(object).str.extract(MEMCPY_RE)
    parts.columns = ["direction", "src", "dst"]
    parts["direction"] = parts["direction"].fillna("unknown")
    host = [_host_memory(d, s if isinstance(s, str) else None, x if isinstance(x, str) else None)
            for d, s, x in parts.itertuples(index=False)]
    nbytes = cp["bytes"].astype(np.int64 if cp["bytes"].dtype.kind == "i" else np.float64).clip(lower=0) \
        if "bytes" in cp else pd.Series(0, index=cp.index)
    # the CPU call that issued each copy (cudaMemcpyAsync / hipMemcpyWithStream): a copy into pageable host
    # memory keeps it waiting until the copy, and all the work queued before it, is done
    cpu_call = cp["launch_dur"].fillna(0.0)
    frame = pd.DataFrame({"direction": parts["direction"], "host_memory": host, "bytes": nbytes,
                          "dur": cp["dur"], "ts": cp["ts"] - t.facts["t0"], "cpu_call": cpu_call,
                          "idle_after": _idle_after(t, cp["end"].to_numpy(float)),
                          "start": cp["ts"].to_numpy(float), "end": cp["end"].to_numpy(float)})
    out = (frame.groupby(["direction", "host_memory"])
           .agg(count=("dur", "size"), bytes=("bytes", "sum"), total_us=("dur", "sum"), first_ts_us=("ts", "min"),
                cpu_call_us=("cpu_call", "sum"), idle_after_us=("idle_after", "sum"))
           .reset_index())
    # the wall time each kind of copy takes inside the steps (copies side by side on several streams count once)
    w0, w1 = merge_intervals(*step_windows(t))
    wall = {key: float(clipped_total(*merge_intervals(part["start"].to_numpy(), part["end"].to_numpy()), w0, w1).sum())
            for key, part in frame.groupby(["direction", "host_memory"])}
    out["in_steps_us"] = [wall[(d, h)] for d, h in zip(out["direction"], out["host_memory"], strict=True)]
    out["calls"] = _calls(t, cp["s_name"].astype(object), parts["direction"], host, out)
    # bytes per microsecond is MB/s; /1e3 gives GB/s
    out["bandwidth_gbps"] = out["bytes"] / out["total_us"].where(out["total_us"] > 0) / 1e3
    out.loc[out["bytes"] <= 0, "bandwidth_gbps"] = None  # the trace did not record sizes (ROCm)
    return out[COLUMNS].sort_values("total_us", ascending=False).reset_index(drop=True)
