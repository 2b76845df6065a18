"""Read one Kineto trace file into a ParsedTrace: HTA's event frame, refusing bad files with a clear reason.

The frame is the one HTA's public per-file parser (`parse_trace_dataframe`) makes, built by
analyzer.traces.read_events (orjson and whole-column steps, held equal to HTA's parser by a test), then HTA's
`transform_correlation_to_index` links launches and kernels. We do not use `TraceAnalysis`, because it needs
`distributedInfo.rank`, drops the events of the last profiler step and assigns iterations row by row. When the
read fails (or finds no events), the file is read again with the standard library only to name the problem of
the bad file; good files are read once.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import re
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import psutil

from analyzer.traces.errors import InvalidTrace
from analyzer.traces.names import COPY_CATS, LAUNCH_RE, MEMCPY_CALL_RE, issuing_calls
from analyzer.traces.read_events import read_events

log = logging.getLogger(__name__)

# A JSON trace held as Python objects takes about this many times its text size (dicts of small strings);
# pandas and HTA's compressed frame come on top while the raw objects are still alive.
MEMORY_PER_TEXT_BYTE = 8.0
STEP_RE = re.compile(r"^ProfilerStep\s*#\s*(\d+)$")
# events that occupy the device (sync markers and GPU-side annotations do not)
GPU_CATS = ["kernel", "Kernel", "gpu_memcpy", "Memcpy", "gpu_memset", "Memset"]
# the event args (HTA's names) the rules read: the device stream, the launch correlation, a copy's bytes
ARGS_READ = ("stream", "correlation", "bytes")


@dataclass
class ParsedTrace:
    """One rank's trace: HTA's event frame (with decoded names) plus the file's metadata."""

    path: str
    rank: int
    meta: dict[str, Any]
    df: pd.DataFrame  # HTA columns + s_name/s_cat (categorical) + launch_ts/launch_dur + iteration
    steps: pd.DataFrame  # step, name, ts, end, dur (CPU ProfilerStep spans or one fallback window)
    warnings: list[str] = field(default_factory=list)
    # whole-trace facts, so that `df` may hold only the events the questions look at one by one (the streaming
    # reader keeps the device's events and the CPU calls named in analyzer.traces.events): events, t0, t_end,
    # cats, cpu_names, launch_calls and launch_us (every kernel launch call, and their CPU time), launch_names,
    # copy_calls (the copy calls that issued each kind of device copy, by correlation id: names.issuing_calls)
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def world_size(self) -> int | None:
        info = self.meta.get("distributedInfo") or {}
        return info.get("world_size")

    @property
    def device_name(self) -> str | None:
        props = self.meta.get("deviceProperties") or []
        return props[0].get("name") if props and isinstance(props[0], dict) else None


def _uncompressed_size(path: Path) -> int:
    """Size of the JSON text: gzip keeps it (mod 4 GiB) in its last four bytes."""
    size = path.stat().st_size
    if path.name.endswith(".gz") and size >= 18:
        with path.open("rb") as fh:
            fh.seek(-4, os.SEEK_END)
            isize = struct.unpack("<I", fh.read(4))[0]
        # ISIZE wraps at 4 GiB; never believe less than the compressed size
        return max(isize, size)
    return size


def check_file_only(path: str | Path) -> int:
    """Refuse what cannot be a trace file before reading it; returns its size in bytes."""
    p = Path(path)
    if not p.exists():
        raise InvalidTrace(str(p), "no such file")
    if not p.is_file():
        raise InvalidTrace(str(p), "is not a file")
    if not (p.name.endswith(".json") or p.name.endswith(".json.gz") or p.name.endswith(".gz")):
        raise InvalidTrace(str(p), "is not a trace: the name must end in .json or .json.gz")
    if p.stat().st_size == 0:
        raise InvalidTrace(str(p), "is empty (0 bytes); the profiler did not finish writing it")
    return p.stat().st_size


def check_trace_file(path: str | Path, memory_budget: int | None = None) -> int:
    """Refuse what cannot be a trace, or what this reader cannot hold, before reading it; returns the expected JSON
    text size in bytes."""
    p = Path(path)
    check_file_only(p)
    text_size = _uncompressed_size(p)
    budget = memory_budget if memory_budget is not None else psutil.virtual_memory().available
    need = int(text_size * MEMORY_PER_TEXT_BYTE)
    if need > budget:
        raise InvalidTrace(
            str(p),
            f"is too large to analyse here: {text_size / 2**20:.0f} MiB of JSON needs about {need / 2**30:.1f} GiB "
            f"of memory and {budget / 2**30:.1f} GiB is available; analyse it on a larger machine or capture "
            "fewer steps (torch.profiler schedule active=1..3)",
        )
    return text_size


def _read_json(p: Path) -> Any:
    try:
        if p.name.endswith(".gz"):
            with gzip.open(p, "rb") as fh:
                raw = fh.read()
        else:
            raw = p.read_bytes()
    except EOFError:
        raise InvalidTrace(str(p), "is truncated: the gzip stream ends early (copy it again)") from None
    except (gzip.BadGzipFile, zlib.error) as exc:
        raise InvalidTrace(str(p), f"is not valid gzip ({exc})") from None
    except OSError as exc:
        raise InvalidTrace(str(p), f"cannot be read ({exc.strerror or exc})") from None
    if not raw.strip():
        raise InvalidTrace(str(p), "holds no data (empty JSON text)")
    try:
        return json.loads(raw)
    except UnicodeDecodeError:
        raise InvalidTrace(str(p), "is not JSON text (binary content)") from None
    except json.JSONDecodeError as exc:
        raise InvalidTrace(str(p), f"is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None


def rank_of(meta: dict[str, Any], p: Path, warnings: list[str]) -> int:
    info = meta.get("distributedInfo")
    rank = info.get("rank") if isinstance(info, dict) else None
    if isinstance(rank, int):
        return rank
    msg = f"{p.name} has no distributedInfo.rank; taken as rank 0"
    log.warning(msg)
    warnings.append(msg)
    return 0


def whole_trace_facts(df: pd.DataFrame) -> dict[str, Any]:
    """The facts a question needs about every event, from a frame that holds every event (the reference reader)."""
    cpu = df["stream"].lt(0)
    codes = [i for i, n in enumerate(df["s_name"].cat.categories) if LAUNCH_RE.search(str(n))]
    launches = df[df["s_name"].cat.codes.isin(codes) & cpu]
    return {"events": int(len(df)), "t0": float(df["ts"].min()), "t_end": float((df["ts"] + df["dur"]).max()),
            "cats": {str(c) for c in df["s_cat"].unique()},
            "cpu_names": {str(n) for n in df.loc[cpu, "s_name"].unique()},
            "launch_calls": int(len(launches)), "launch_us": float(launches["dur"].sum()),
            "launch_names": sorted({str(n) for n in launches["s_name"].unique()}),
            "copy_calls": _copy_calls(df, cpu)}


def _copy_calls(df: pd.DataFrame, cpu: pd.Series) -> dict[str, list[str]]:
    """names.issuing_calls over a frame of every event (in file order)."""
    if "correlation" not in df.columns:
        return {}
    table = df["s_name"].cat.categories
    codes = df["s_name"].cat.codes
    corr = np.nan_to_num(df["correlation"].to_numpy(float), nan=-1).astype(np.int64)  # null: no id
    calls = (cpu & codes.isin([i for i, n in enumerate(table) if MEMCPY_CALL_RE.match(str(n))])
             & (corr >= 0)).to_numpy()
    copies = (~cpu & df["s_cat"].isin(COPY_CATS)).to_numpy()
    codes = codes.to_numpy(np.int64)
    return issuing_calls(codes[copies], corr[copies], codes[calls], corr[calls], table)


def add_launch_columns(df: pd.DataFrame) -> None:
    """launch_ts / launch_dur: start and CPU time of the linked event (the launch of a kernel), NaN without one."""
    if "index_correlation" not in df.columns:
        df["launch_ts"] = np.nan
        df["launch_dur"] = np.nan
        return
    corr = df["index_correlation"].to_numpy()
    linked = corr > 0
    for col, src in (("launch_ts", "ts"), ("launch_dur", "dur")):
        vals = np.full(len(df), np.nan)
        vals[linked] = df[src].reindex(corr[linked]).to_numpy(float)
        df[col] = vals


def _find_steps(df: pd.DataFrame, facts: dict[str, Any]) -> pd.DataFrame:
    """ProfilerStep#N spans on the CPU; without them the whole trace is one step (a micro-benchmark)."""
    cats = df["s_name"].cat.categories
    step_of = {code: int(m.group(1)) for code, name in enumerate(cats) if (m := STEP_RE.match(str(name)))}
    codes = df["s_name"].cat.codes
    cpu = df[codes.isin(list(step_of)) & df["stream"].lt(0) & df["s_cat"].isin(["user_annotation", "cpu_op"])]
    spans = cpu[["ts", "dur"]].assign(step=codes[cpu.index].map(step_of), name=cpu["s_name"].astype(object))
    spans = spans.drop_duplicates("step").sort_values("ts")
    if spans.empty:
        # no steps: a micro-benchmark; take the span the device was in use (from the first launch), else all
        gpu = df[df["stream"].ge(0) & df["s_cat"].isin(GPU_CATS)]
        if gpu.empty:
            ts0, ts1, name = facts["t0"], facts["t_end"], "whole trace"
        else:
            launches = gpu["launch_ts"].dropna()
            ts0 = float(min(gpu["ts"].min(), launches.min() if len(launches) else np.inf))
            ts1, name = float((gpu["ts"] + gpu["dur"]).max()), "device active span"
        spans = pd.DataFrame({"step": [0], "name": [name], "ts": [ts0], "dur": [ts1 - ts0]})
    spans["end"] = spans["ts"] + spans["dur"]
    return spans[["step", "name", "ts", "end", "dur"]].reset_index(drop=True)


def _assign_iterations(df: pd.DataFrame, steps: pd.DataFrame) -> None:
    """CPU events take the step whose span holds their start; GPU events take the step of their launch."""
    starts, ends = steps["ts"].to_numpy(), steps["end"].to_numpy()
    ts = df["ts"].to_numpy()
    pos = np.searchsorted(starts, ts, side="right") - 1
    ok = (pos >= 0) & (ts < ends[np.clip(pos, 0, None)])
    it = np.where(ok, steps["step"].to_numpy()[np.clip(pos, 0, None)], -1)
    # a device event takes the step its launch started in
    launch = df["launch_ts"].to_numpy(float)
    gpu = (df["stream"].to_numpy() >= 0) & ~np.isnan(launch)
    lpos = np.searchsorted(starts, launch[gpu], side="right") - 1
    lok = (lpos >= 0) & (launch[gpu] < ends[np.clip(lpos, 0, None)])
    it[gpu] = np.where(lok, steps["step"].to_numpy()[np.clip(lpos, 0, None)], -1)
    df["iteration"] = it.astype(np.int32)


def _diagnose(p: Path, exc: Exception | None) -> InvalidTrace:
    """Why HTA could not parse this file, from the raw JSON (only read again on this failure path)."""
    record = _read_json(p)  # raises InvalidTrace for unreadable, truncated or non-JSON files
    if not isinstance(record, dict):
        kind = type(record).__name__
        return InvalidTrace(str(p), f"is JSON but not a trace: the top level is a {kind}, not an object")
    if "traceEvents" not in record:
        return InvalidTrace(str(p), "is JSON but not a Kineto trace: it has no traceEvents")
    events = record["traceEvents"]
    if not isinstance(events, list) or not events:
        return InvalidTrace(str(p), "has no events (traceEvents is empty)")
    fields = set().union(*(e.keys() for e in events if isinstance(e, dict)))
    missing = {"ts", "dur", "name", "cat"} - fields
    if missing:
        return InvalidTrace(str(p), f"has no complete ('X') events: fields {sorted(missing)} are missing")
    if exc is None:
        return InvalidTrace(str(p), "has no complete ('X') events with a duration")
    return InvalidTrace(str(p), f"has malformed events ({type(exc).__name__}: {exc})")


def parse_trace(path: str | Path, memory_budget: int | None = None) -> ParsedTrace:
    """Parse one trace file; raises InvalidTrace naming the file and the problem."""
    # HTA loads on the first parse only, so the CLI and the agent start light
    from hta.common.trace import transform_correlation_to_index
    from hta.configs.parser_config import ParserConfig

    p = Path(path)
    check_trace_file(p, memory_budget)
    args = {a.raw_name: a.default_value for a in ParserConfig.get_default_args() if a.name in ARGS_READ}
    hta_log = logging.getLogger("hta")
    level = hta_log.level
    hta_log.setLevel(logging.ERROR)  # HTA logs every parse at WARNING
    try:
        try:
            meta, df, symbols = read_events(p, args)
        except (OSError, EOFError, zlib.error, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise _diagnose(p, exc) from None
        if df.empty or not {"ts", "dur", "name", "cat"} <= set(df.columns):
            raise _diagnose(p, None)
        try:
            df = transform_correlation_to_index(df, symbols)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise InvalidTrace(str(p), f"has malformed events ({type(exc).__name__}: {exc})") from None
    finally:
        hta_log.setLevel(level)
    warnings: list[str] = []
    rank = rank_of(meta, p, warnings)

    table = symbols.get_sym_table()
    df["s_name"] = pd.Categorical.from_codes(df["name"].astype(np.int64), categories=table)
    df["s_cat"] = pd.Categorical.from_codes(df["cat"].astype(np.int64), categories=table)
    df["end"] = df["ts"] + df["dur"]
    add_launch_columns(df)
    return finish(p, rank, meta, df, whole_trace_facts(df), warnings)


def finish(p: Path, rank: int, meta: dict[str, Any], df: pd.DataFrame, facts: dict[str, Any],
           warnings: list[str]) -> ParsedTrace:
    """Steps and iterations over an event frame (every event, or the streaming reader's selection)."""
    steps = _find_steps(df, facts)
    if steps["name"].iloc[0] in ("whole trace", "device active span"):
        warnings.append(f"no ProfilerStep#N spans: one step taken over the {steps['name'].iloc[0]}")
    _assign_iterations(df, steps)
    return ParsedTrace(path=str(p), rank=rank, meta=meta, df=df, steps=steps, warnings=warnings, facts=facts)
