"""Read a Kineto trace file into the event frame HTA's parser makes, with the JSON decoded by orjson and every
step done on whole columns.

HTA 0.5.0's parser (hta.common.trace_parser.parse_trace_dataframe, JSON backend, the only one that needs no extra
package) decodes with the standard library's json, lifts each kept event arg into a column and normalises stream
numbers row by row (DataFrame.apply over every event): on a 100k-event trace that is about four times a bare orjson
decode of the file, and none of its public options (parser backend, args kept, trace_memory) changes those steps.
This reader makes the same frame: HTA's columns (index, cat, name, pid, tid, ts, dur, the kept args), HTA's own
nanosecond rounding (round_down_time_stamps), the same rows dropped (no dur or cat, the "Trace" span), the same
stream normalisation (int(stream), -1 when it is not a number), names and categories encoded by HTA's
TraceSymbolTable, integers downcast. tests/analyzer/test_trace_reader.py holds it equal to HTA's parser on every
shared trace.
"""

from __future__ import annotations

import gzip
from operator import itemgetter
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pandas as pd

DROPPED_KEYS = frozenset({"ph", "id", "bp", "s", "args"})  # keys HTA's frame drops (args become columns)
TEXT_KEYS = frozenset({"cat", "name"})
MISSING = float("nan")


def read_trace_bytes(path: Path) -> bytes:
    if path.name.endswith(".gz"):
        with gzip.open(path, "rb") as fh:
            return fh.read()
    return path.read_bytes()


def _stream_number(value: Any) -> int:
    try:
        return int(value)
    except ValueError:
        return -1


def _column_kind(kept: pd.Series, dropped: list[dict[str, Any]], key: str) -> Any:
    """The dtype pandas gives a column over all events, from its kept values' dtype and the dropped events' values:
    float64 when an int column's dropped values hold a float or a gap, object when they hold anything but numbers,
    else None (the kept values' dtype stands)."""
    if not dropped or kept.dtype.kind == "O":
        return None
    seen = pd.api.types.infer_dtype([e.get(key, MISSING) for e in dropped], skipna=False)
    numbers = ("floating", "integer-na", "mixed-integer-float")  # a float or a gap among them
    if seen == "integer" or (seen in numbers and kept.dtype.kind == "f"):
        return None
    return np.float64 if seen in numbers else object


def _values(events: list[dict[str, Any]], columns: list[str]) -> list[Any]:
    """Each column's values over `events`, NaN where an event lacks the key; in one C-level pass when every event
    has every key (the usual Kineto event)."""
    try:
        return list(zip(*map(itemgetter(*columns), events), strict=True)) if len(columns) > 1 else \
            [[e[columns[0]] for e in events]]
    except KeyError:
        return [[e.get(k, MISSING) for e in events] for k in columns]


def _columns(events: list[dict[str, Any]]) -> list[str]:
    """The frame's columns: every event key but those HTA drops, in the order keys first appear (as pandas orders
    a frame of dicts)."""
    wanted = set().union(*events) - DROPPED_KEYS
    order: list[str] = []
    for e in events:  # the first events hold nearly every key, so this stops early
        for k in e:
            if k in wanted and k not in order:
                order.append(k)
        if len(order) == len(wanted):
            break
    return order


def _column(values: list[Any], text: bool = False) -> Any:
    """A column's values as the array pandas would infer: numpy's own conversion where every value is a number
    (NaN a gap), pandas' inference otherwise."""
    if text:
        return np.array(values, dtype=object)
    arr = np.array(values)
    return arr if arr.ndim == 1 and arr.dtype.kind in "if" else pd.Series(values).to_numpy()


def _check_types(df: pd.DataFrame, numbers: tuple[str, ...], texts: tuple[str, ...] = ()) -> None:
    """TypeError naming the column when a kept event's time, size or id is no number, or its name or category no
    string (a missing number is a gap, as in HTA's frame): the streaming reader refuses the same events."""
    for col in numbers:
        if col in df and df[col].dtype.kind not in "if":
            bad = [v for v in pd.unique(df[col]) if v is not None and v.__class__ not in (int, float)]
            if bad:
                raise TypeError(f"{col} holds a {type(bad[0]).__name__} ({bad[0]!r:.40}), not a number")
    for col in texts:
        bad = [v for v in pd.unique(df[col]) if v.__class__ is not str]
        if bad:
            raise TypeError(f"{col} is missing or not a string ({bad[0]!r:.40})")


def _index_dtype(n: int) -> Any:
    """The integer type pd.to_numeric(downcast="integer") gives positions 0..n-1."""
    return pd.to_numeric(pd.Series([0, n - 1]), downcast="integer").dtype


def read_events(path: Path, args: dict[str, int]) -> tuple[dict[str, Any], pd.DataFrame, Any]:
    """(metadata, events, HTA TraceSymbolTable) as parse_trace_dataframe returns them with `args` ({arg: default})
    kept.

    Raises what decoding or a malformed trace raises (ValueError, KeyError, TypeError, AttributeError, OSError);
    the caller names the problem."""
    # HTA loads on the first read only, so the CLI and the agent start light
    from hta.common.trace_parser import round_down_time_stamps  # noqa: PLC0415
    from hta.common.trace_symbol_table import TraceSymbolTable  # noqa: PLC0415

    record = orjson.loads(read_trace_bytes(path))
    if not isinstance(record, dict):
        raise TypeError(f"the top level is a {type(record).__name__}, not an object")
    events = record["traceEvents"]
    meta = {k: v for k, v in record.items() if k != "traceEvents"}
    if not isinstance(events, list) or not events:
        return meta, pd.DataFrame(), TraceSymbolTable()
    columns = _columns(events)
    if not {"ts", "dur", "cat", "name"} <= set(columns):
        return meta, pd.DataFrame(), TraceSymbolTable()
    # HTA's frame holds every event and then drops those without a duration or category (about 40 %: flow and
    # metadata events); the kept events alone are built here, each column given the type pandas infers over all
    # events (a column a dropped event leaves out or holds a float in is float, one a string is in is object)
    kept, dropped = [], []
    for i, e in enumerate(events):
        if e.get("dur") is not None and (c := e.get("cat")) is not None and c != "Trace":
            kept.append(i)
        else:
            dropped.append(e)
    if not kept:
        return meta, pd.DataFrame(), TraceSymbolTable()
    kept_events = [events[i] for i in kept]
    df = pd.DataFrame({k: _column(v, text=k in TEXT_KEYS) for k, v in zip(columns, _values(kept_events, columns),
                                                                           strict=True)},
                      index=pd.Index(kept))
    _check_types(df, ("ts", "dur"), ("name", "cat"))
    kinds = {k: _column_kind(df[k], dropped, k) for k in columns}
    for k, kind in kinds.items():
        if kind is not None:
            df[k] = df[k].astype(kind)
    rounded = df["ts"].dtype == np.float64
    round_down_time_stamps(df)
    if rounded and "end" in df:
        # HTA rounds over all events, where a missing ts or dur leaves a gap: those columns come out float there
        ts_gap = df["ts"].isna().any() or any(e.get("ts") is None for e in dropped)
        dur_gap = df["dur"].isna().any() or any(e.get("dur") is None for e in dropped)
        if ts_gap:
            df["ts"] = df["ts"].astype(np.float64)
        if ts_gap or dur_gap:
            df["end"], df["dur"] = df["end"].astype(np.float64), df["dur"].astype(np.float64)
    df.insert(0, "index", np.asarray(kept, dtype=_index_dtype(len(events))))

    lifted: dict[str, list[Any]] = {name: [] for name in args}
    defaults = list(args.items())
    for e in kept_events:
        a = e.get("args")
        if isinstance(a, dict):
            for name, default in defaults:
                lifted[name].append(a.get(name, default))
        else:
            for name, default in defaults:
                lifted[name].append(default)
    for name, values in lifted.items():
        df[name] = pd.Series(_column(values), index=df.index)
    _check_types(df, ("correlation", "bytes"))
    if "stream" in df and df["stream"].dtype.kind != "i":
        values = pd.unique(df["stream"])
        df["stream"] = df["stream"].map({v: _stream_number(v) for v in values}).astype(np.int64)

    symbols = TraceSymbolTable()
    symbols.add_symbols(set(df["cat"].unique()).union(set(df["name"].unique())))
    ids = symbols.get_sym_id_map()
    for col in ("cat", "name"):
        df[col] = df[col].map(ids).astype(np.int64)
    for col in df.columns:
        if df[col].dtype.kind == "i":
            df[col] = pd.to_numeric(df[col], errors="coerce", downcast="integer")
    return meta, df, symbols
