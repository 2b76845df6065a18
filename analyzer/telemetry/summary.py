"""What the telemetry detectors judge: a window's statistics per (workflow, device) and its idle and
orphaned-memory runs, built from pieces that each summarise a stretch of time.

A piece (`summarise`) is made from a TelemetryWindow's samples of [lo, hi). Pieces of consecutive stretches combine
(`combine`) into what the window's samples would have given:
- sums, counts and extremes add up exactly (held and GPU seconds, utilisation and SM-activity means, peaks, spans);
- a run of idle (or orphaned-memory) samples that reaches a piece's end and one that starts the next piece are one
  run when the samples meet as they would within a piece (the next starts at most a second after the earlier
  one's last sample ends), so a run is never cut at an hour;
- a pair's p95 utilisation is exact when one piece holds all its held samples; over several it comes from 1 %
  utilisation bins, each value read as its bin's upper edge (exact for NVML's whole percents; otherwise at most
  one point high, so the waste it implies is never overstated).
Kept pieces differ from one window's samples only where a sample's duration (`dt`, the time to the device's next
sample) is cut at a piece's end: the last sample of a piece counts for the device's median interval.

The hourly rollup keeps one piece per closed hour (analyzer.telemetry.hour_summaries); detection over a day combines
the kept hours with pieces made on the spot for the rest of the window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from analyzer.telemetry.common import KEYS, runs
from analyzer.telemetry.device_words import DeviceWords, device_words
from analyzer.telemetry.frame import TelemetryWindow
from analyzer.telemetry.thresholds import Thresholds
from store.db import Store

HIST_BINS = 1000  # bin k holds utilisation in ((k - 1) / 1000, k / 1000], read back as k / 1000
RUN_SLACK_S = 1.0  # as analyzer.telemetry.common.runs: a run continues when the next sample is at most this late

PAIR_COLUMNS = ("workflow_id", "device_id", "held_n", "held_s", "gpu_s", "util_n", "util_sum", "util_p95", "sm_n",
                "sm_sum", "mem_peak", "mem_total", "first_ts", "last_ts", "idle_n", "idle_share_sum", "seen_last_ts")
HIST_COLUMNS = ("workflow_id", "device_id", "bin", "count")
RUN_COLUMNS = ("kind", "workflow_id", "device_id", "start", "end", "duration_s", "samples", "util_sum", "mem_max",
               "open_start", "open_end", "before_ts", "before_workflows")
IDLE, ORPHAN = "idle", "orphan"
_SEP = "\n"  # between the workflow ids of `before_workflows`


@dataclass
class Piece:
    """The detectors' summary of [start, end): see the module docstring."""

    start: float
    end: float
    first_ts: float | None  # the first sample's time and the last sample's end (None: no samples)
    last_end: float | None
    pairs: pd.DataFrame  # PAIR_COLUMNS, one row per (workflow, device) with samples in the piece
    hist: pd.DataFrame  # HIST_COLUMNS: held samples' utilisation per pair and 1 % bin
    runs: pd.DataFrame  # RUN_COLUMNS: idle runs (per pair) and orphaned-memory runs (per device, workflow_id "")


def _frame(columns: tuple[str, ...], data: dict[str, Any] | None = None) -> pd.DataFrame:
    text = {"workflow_id", "kind", "before_workflows"}
    flags = {"open_start", "open_end"}
    if data is None:
        return pd.DataFrame({c: pd.Series(dtype="object" if c in text else "bool" if c in flags else "float64")
                             for c in columns})
    return pd.DataFrame({c: data[c] for c in columns})


def summarise(window: TelemetryWindow, th: Thresholds, lo: float | None = None, hi: float | None = None) -> Piece:
    """The piece of the window's samples in [lo, hi) (default: the whole window)."""
    lo = window.start if lo is None else float(lo)
    hi = window.end if hi is None else float(hi)
    u, s = window.usage, window.samples
    if lo > window.start or hi < window.end:
        u = u[(u["ts"] >= lo) & (u["ts"] < hi)]
        s = s[(s["ts"] >= lo) & (s["ts"] < hi)]
    if s.empty:
        return Piece(lo, hi, None, None, _frame(PAIR_COLUMNS), _frame(HIST_COLUMNS), _frame(RUN_COLUMNS))
    first_ts, last_end = float(s["ts"].min()), float((s["ts"] + s["dt"]).max())
    if u.empty:
        pairs, hist, idle_runs = _frame(PAIR_COLUMNS), _frame(HIST_COLUMNS), _frame(RUN_COLUMNS)
    else:
        idle = u["held"] & u["gpu_util"].notna() & (u["gpu_util"] <= th.idle_holder.util_max)
        pairs, hist = _pair_stats(u, idle)
        idle_runs = _runs(u, idle, KEYS, th.idle_holder.min_duration_s, IDLE)
    orphan = (s["n_workflows"] == 0) & s["mem_used"].notna() & (s["mem_used"] >= th.zombie_memory.mem_min_bytes)
    orphan_runs = _runs(s, orphan, ["device_id"], th.zombie_memory.min_duration_s, ORPHAN)
    if not orphan_runs.empty:
        orphan_runs = _with_before(orphan_runs, u)
    found = [r for r in (idle_runs, orphan_runs) if not r.empty]
    all_runs = pd.concat(found, ignore_index=True) if found else _frame(RUN_COLUMNS)
    return Piece(lo, hi, first_ts, last_end, pairs, hist, all_runs)


def merged(pieces: list[Piece]) -> Piece:
    """Pieces of one stretch of time over disjoint groups of devices as one piece."""
    first = pieces[0]
    if any((p.start, p.end) != (first.start, first.end) for p in pieces):
        raise ValueError("only pieces of the same stretch of time merge")
    firsts = [p.first_ts for p in pieces if p.first_ts is not None]
    ends = [p.last_end for p in pieces if p.last_end is not None]

    def frames(name: str, columns: tuple[str, ...]) -> pd.DataFrame:
        found = [getattr(p, name) for p in pieces if not getattr(p, name).empty]
        return pd.concat(found, ignore_index=True) if found else _frame(columns)

    return Piece(first.start, first.end, min(firsts) if firsts else None, max(ends) if ends else None,
                 frames("pairs", PAIR_COLUMNS), frames("hist", HIST_COLUMNS), frames("runs", RUN_COLUMNS))


def _pair_stats(u: pd.DataFrame, idle: pd.Series) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(pairs, hist) of one piece's usage rows."""
    seen = u.groupby(KEYS, sort=False).agg(seen_last_ts=("ts", "max"))
    h = u[u["held"]]
    h = h.assign(gpu_s=h["dt"] * h["share"], end_ts=h["ts"] + h["dt"])
    g = h.groupby(KEYS, sort=False)
    stats = g.agg(held_n=("ts", "size"), held_s=("dt", "sum"), gpu_s=("gpu_s", "sum"), util_n=("gpu_util", "count"),
                  util_sum=("gpu_util", "sum"), sm_n=("sm_active", "count"), sm_sum=("sm_active", "sum"),
                  mem_peak=("wf_mem", "max"), mem_total=("mem_total", "max"), first_ts=("ts", "min"),
                  last_ts=("end_ts", "max"))
    if not h.empty:
        stats["util_p95"] = g["gpu_util"].quantile(0.95)
    else:
        stats["util_p95"] = pd.Series(dtype="float64")
    idle_rows = u.loc[idle].groupby(KEYS, sort=False).agg(idle_n=("share", "size"), idle_share_sum=("share", "sum"))
    pairs = seen.join(stats, how="left").join(idle_rows, how="left")
    zero = ["held_n", "held_s", "gpu_s", "util_n", "util_sum", "sm_n", "sm_sum", "idle_n", "idle_share_sum"]
    pairs[zero] = pairs[zero].fillna(0.0)
    pairs = pairs.reset_index()
    hv = h.loc[h["gpu_util"].notna(), [*KEYS, "gpu_util"]]
    bins = np.clip(np.ceil(hv["gpu_util"].to_numpy(dtype="float64") * HIST_BINS - 1e-9), 0, HIST_BINS)
    hist = (pd.DataFrame({"workflow_id": hv["workflow_id"].to_numpy(), "device_id": hv["device_id"].to_numpy(),
                          "bin": bins})
            .groupby([*KEYS, "bin"], sort=False).size().rename("count").reset_index())
    return _frame(PAIR_COLUMNS, {c: pairs[c].astype("float64") if c != "workflow_id" else pairs[c]
                                 for c in PAIR_COLUMNS}), hist.astype({"bin": "float64", "count": "float64"})


def _runs(frame: pd.DataFrame, flag: pd.Series, keys: list[str], min_duration_s: float, kind: str) -> pd.DataFrame:
    """Runs of flagged rows per key, as RUN_COLUMNS; a run shorter than `min_duration_s` is kept only when it
    touches the piece's edge (the next or the earlier piece may continue it)."""
    found = runs(frame, flag, keys)
    if found.empty:
        return _frame(RUN_COLUMNS)
    edges = frame.groupby(keys, sort=False)["ts"].agg(["min", "max"])
    at = pd.MultiIndex.from_frame(found[keys]) if len(keys) > 1 else pd.Index(found[keys[0]])
    open_start = found["start"].to_numpy() == edges["min"].reindex(at).to_numpy()
    open_end = found["last"].to_numpy() == edges["max"].reindex(at).to_numpy()
    keep = (found["duration_s"].to_numpy() >= min_duration_s) | open_start | open_end
    found, open_start, open_end = found[keep], open_start[keep], open_end[keep]
    n = len(found)
    util = found["util_mean"] * found["samples"] if "util_mean" in found else pd.Series(np.nan, index=found.index)
    return _frame(RUN_COLUMNS, {
        "kind": [kind] * n,
        "workflow_id": found["workflow_id"].to_numpy() if "workflow_id" in keys else [""] * n,
        "device_id": found["device_id"].astype("float64").to_numpy(),
        "start": found["start"].to_numpy(), "end": found["end"].to_numpy(),
        "duration_s": found["duration_s"].to_numpy(), "samples": found["samples"].astype("float64").to_numpy(),
        "util_sum": util.to_numpy(dtype="float64"),
        "mem_max": found["mem_max"].to_numpy(dtype="float64") if "mem_max" in found else np.full(n, np.nan),
        "open_start": open_start, "open_end": open_end,
        "before_ts": np.full(n, np.nan), "before_workflows": [""] * n,
    })


def _with_before(orphans: pd.DataFrame, usage: pd.DataFrame) -> pd.DataFrame:
    """Each orphaned-memory run with the workflows last seen on its device before it started (in this piece)."""
    orphans = orphans.copy()
    # one pass over the usage rows for the devices with orphaned memory, then each run looks at its device's rows
    on_device = {int(d): rows for d, rows in usage[usage["device_id"].isin(orphans["device_id"].unique())]
                 .groupby("device_id", sort=False)}
    for i, run in orphans.iterrows():
        rows = on_device.get(int(run["device_id"]))
        if rows is None:
            continue
        seen = rows[rows["ts"] < run["start"]]
        if seen.empty:
            continue
        last = float(seen["ts"].max())
        orphans.at[i, "before_ts"] = last
        orphans.at[i, "before_workflows"] = _SEP.join(sorted(map(str, seen.loc[seen["ts"] == last, "workflow_id"]
                                                                 .unique())))
    return orphans


@dataclass
class WindowSummary:
    """Pieces of [start, end) combined: what every detector reads."""

    start: float
    end: float
    # per (workflow, device) over the samples where the workflow held the device (index KEYS): held_s, gpu_s,
    # util_mean, util_p95, sm_active_mean, sm_samples, mem_peak, mem_total, first_ts, last_ts, idle_share (mean share
    # of the device over its idle samples)
    stats: pd.DataFrame
    idle_runs: pd.DataFrame  # workflow_id, device_id, start, end, duration_s, samples, util_mean, mem_max
    orphan_runs: pd.DataFrame  # device_id, start, end, duration_s, samples, mem_max, before_ts, before_workflows
    seen: pd.DataFrame  # workflow_id, device_id, seen_last_ts, piece_end: when each pair was last seen per piece
    span_s: float
    devices: pd.DataFrame  # device_id -> host_id, index, name, memory_total
    workflows: pd.DataFrame  # workflow_id -> team, gpus
    store: Store | None = None
    cache: dict[str, Any] = field(default_factory=dict)

    def per_day(self, gpu_seconds: float) -> float:
        """GPU-seconds seen in this window as GPU-hours per day at the same rate."""
        return 0.0 if self.span_s <= 0 else gpu_seconds / self.span_s * 24.0

    def device_label(self, device_id: int) -> str:
        if "labels" not in self.cache:
            d = self.devices
            self.cache["labels"] = {
                int(i): f"device {i} ({h}:{x}, {n})" for i, h, x, n in zip(d.index, d["host_id"], d["index"], d["name"],
                                                                          strict=True)
            }
        return self.cache["labels"].get(int(device_id), f"device {device_id}")

    def device_short(self, device_id: int) -> str:
        """host:index of the device, for titles."""
        if "short" not in self.cache:
            d = self.devices
            self.cache["short"] = {int(i): f"{h}:{x}"
                                   for i, h, x in zip(d.index, d["host_id"], d["index"], strict=True)}
        return self.cache["short"].get(int(device_id), f"device {device_id}")

    def device_words(self, device_id: int) -> DeviceWords:
        """The words advice uses for the device (NVIDIA GPU, CPU device or unknown), from its source and name."""
        if device_id not in self.devices.index:
            return device_words(None, None)
        row = self.devices.loc[device_id]
        return device_words(row.get("source"), row.get("name"))

    def device_total(self, device_id: int) -> float | None:
        if device_id in self.devices.index:
            total = self.devices.loc[device_id, "memory_total"]
            return None if pd.isna(total) else float(total)
        return None


def combine(pieces: list[Piece], th: Thresholds, *, start: float, end: float, devices: pd.DataFrame,
            workflows: pd.DataFrame, store: Store | None = None) -> WindowSummary:
    """Pieces of consecutive (or, for disjoint devices, the same) stretches of [start, end) as one summary."""
    with_pairs = [p for p in pieces if not p.pairs.empty]
    pairs = pd.concat([p.pairs.assign(piece_end=p.end) for p in with_pairs], ignore_index=True) if with_pairs else \
        _frame(PAIR_COLUMNS).assign(piece_end=pd.Series(dtype="float64"))
    pairs["device_id"] = pairs["device_id"].astype("int64")
    hists = [p.hist for p in pieces if not p.hist.empty]
    hist = pd.concat(hists, ignore_index=True) if hists else _frame(HIST_COLUMNS)
    firsts = [p.first_ts for p in pieces if p.first_ts is not None]
    ends = [p.last_end for p in pieces if p.last_end is not None]
    span = max(ends) - min(firsts) if firsts else 0.0
    idle_runs, orphan_runs = _joined_runs(pieces, th)
    return WindowSummary(
        start=start, end=end, stats=_stats(pairs, hist), idle_runs=idle_runs, orphan_runs=orphan_runs,
        seen=pairs[["workflow_id", "device_id", "seen_last_ts", "piece_end"]], span_s=float(span),
        devices=devices, workflows=workflows, store=store,
    )


def _stats(pairs: pd.DataFrame, hist: pd.DataFrame) -> pd.DataFrame:
    held = pairs[pairs["held_n"] > 0]
    columns = ["held_s", "gpu_s", "util_mean", "util_p95", "sm_active_mean", "sm_samples", "mem_peak", "mem_total",
               "first_ts", "last_ts", "idle_share"]
    if held.empty:
        return pd.DataFrame({c: pd.Series(dtype="float64") for c in columns},
                            index=pd.MultiIndex.from_arrays([[], []], names=KEYS))
    g = held.groupby(KEYS, sort=False)
    out = g.agg(pieces=("held_n", "size"), held_s=("held_s", "sum"), gpu_s=("gpu_s", "sum"), util_n=("util_n", "sum"),
                util_sum=("util_sum", "sum"), sm_samples=("sm_n", "sum"), sm_sum=("sm_sum", "sum"),
                mem_peak=("mem_peak", "max"), mem_total=("mem_total", "max"), first_ts=("first_ts", "min"),
                last_ts=("last_ts", "max"), one_p95=("util_p95", "first"))
    idle = pairs.groupby(KEYS, sort=False)[["idle_n", "idle_share_sum"]].sum()
    out = out.join(idle, how="left")
    out["util_mean"] = out["util_sum"] / out["util_n"].where(out["util_n"] > 0)
    out["sm_active_mean"] = out["sm_sum"] / out["sm_samples"].where(out["sm_samples"] > 0)
    out["idle_share"] = out["idle_share_sum"] / out["idle_n"].where(out["idle_n"] > 0)
    out["util_p95"] = out["one_p95"]
    several = out["pieces"] > 1
    if several.any():
        out.loc[several, "util_p95"] = _hist_quantile(hist, out.index[several], 0.95)
    return out[columns]


def _hist_quantile(hist: pd.DataFrame, pairs: pd.MultiIndex, q: float) -> np.ndarray:
    """The q-quantile (linear between order statistics, as pandas) of each pair's binned utilisation."""
    h = hist.astype({"device_id": "int64"}).groupby([*KEYS, "bin"], sort=True)["count"].sum().reset_index()
    key = pd.MultiIndex.from_frame(h[KEYS])
    wanted = key.isin(pairs)
    h, key = h[wanted], key[wanted]
    if h.empty:
        return np.full(len(pairs), np.nan)
    counts = h["count"].to_numpy()
    cum = np.cumsum(counts)
    codes, uniques = pd.factorize(key)
    totals = np.bincount(codes, weights=counts)
    offsets = np.concatenate([[0.0], np.cumsum(totals)[:-1]])
    pos = q * (totals - 1)
    lo, hi = np.floor(pos), np.ceil(pos)
    bins = h["bin"].to_numpy() / HIST_BINS
    v_lo = bins[np.searchsorted(cum, offsets + lo, side="right")]
    v_hi = bins[np.searchsorted(cum, offsets + hi, side="right")]
    per_pair = pd.Series(v_lo + (v_hi - v_lo) * (pos - lo), index=uniques)
    return per_pair.reindex(pairs).to_numpy()


def _joined_runs(pieces: list[Piece], th: Thresholds) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(idle runs, orphaned-memory runs) of the pieces, those that meet at a piece's edge joined, the short
    dropped."""
    found = [p.runs.assign(piece_start=p.start, piece_end=p.end) for p in pieces if not p.runs.empty]
    if not found:
        r = _frame(RUN_COLUMNS)
    else:
        r = pd.concat(found, ignore_index=True)
        r["device_id"] = r["device_id"].astype("int64")
        r = r.sort_values(["kind", "workflow_id", "device_id", "start"], kind="stable").reset_index(drop=True)
        prev = r.shift()
        joins = ((r["kind"] == prev["kind"]) & (r["workflow_id"] == prev["workflow_id"])
                 & (r["device_id"] == prev["device_id"]) & prev["open_end"].eq(True)
                 & r["open_start"] & (r["piece_start"] == prev["piece_end"])
                 & (r["start"] <= prev["end"] + RUN_SLACK_S))
        r["_run"] = (~joins).cumsum()
        r = r.groupby("_run", sort=False).agg(
            kind=("kind", "first"), workflow_id=("workflow_id", "first"), device_id=("device_id", "first"),
            start=("start", "min"), end=("end", "max"), duration_s=("duration_s", "sum"), samples=("samples", "sum"),
            util_sum=("util_sum", "sum"), mem_max=("mem_max", "max"), before_ts=("before_ts", "first"),
            before_workflows=("before_workflows", "first"),
        ).reset_index(drop=True)
    r["util_mean"] = r["util_sum"] / r["samples"].where(r["samples"] > 0)
    idle = r[(r["kind"] == IDLE) & (r["duration_s"] >= th.idle_holder.min_duration_s)]
    orphan = r[(r["kind"] == ORPHAN) & (r["duration_s"] >= th.zombie_memory.min_duration_s)]
    idle = idle[["workflow_id", "device_id", "start", "end", "duration_s", "samples", "util_mean", "mem_max"]]
    orphan = orphan[["device_id", "start", "end", "duration_s", "samples", "mem_max", "before_ts",
                     "before_workflows"]]
    return idle.reset_index(drop=True), orphan.reset_index(drop=True)


def before_workflows(run: pd.Series) -> list[tuple[str, float]]:
    """The workflows an orphaned-memory run's piece saw on its device before it started ([] when none)."""
    if not isinstance(run["before_workflows"], str) or not run["before_workflows"] or math.isnan(run["before_ts"]):
        return []
    return [(w, float(run["before_ts"])) for w in run["before_workflows"].split(_SEP)]
