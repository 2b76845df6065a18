"""What the streaming reader (analyzer.traces.stream_read) makes of one event's fields: the flags of a name (kept in
the columns, a launch call, read only for a CPU-only trace's arithmetic share, a copy call), a stream or correlation
id as an int, a batch's numbers as one array, the record a CPU call is spilled as, and, for a batch the read could not
take, what is wrong with its first malformed event."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from analyzer.traces.cpu_work import MATH_OPS
from analyzer.traces.dataloader import DATALOADER_RE
from analyzer.traces.names import LAUNCH_RE, MEMCPY_CALL_RE, SYNC_NAMES
from analyzer.traces.parse import STEP_RE

KEEP, LAUNCH, MATH_ONLY = 1, 2, 4  # MATH_ONLY: only a CPU-only trace's arithmetic share reads these calls
COPY_CALL = 8  # a copy call (cudaMemcpyAsync, ...): only its correlation id and name are kept
SPILL = np.dtype([("corr", "i8"), ("idx", "i8"), ("ts", "f8"), ("dur", "f8"), ("launch", "i1")])


def stream_number(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return -1


def name_flags(name: str) -> int:
    f = KEEP if (STEP_RE.match(name) or name in SYNC_NAMES or DATALOADER_RE.search(name)) else 0
    if not f and MATH_OPS.match(name):
        f = KEEP | MATH_ONLY
    return f | (LAUNCH if LAUNCH_RE.search(name) else 0) | (COPY_CALL if MEMCPY_CALL_RE.match(name) else 0)


def correlation_id(value: Any) -> int:
    """A correlation id that is not an int: null is none (-1, as HTA's frame leaves it unlinked); a whole float is
    its int; anything else is a malformed event (ValueError)."""
    if value is None:
        return -1
    if value.__class__ is float and value.is_integer():
        return int(value)
    raise ValueError("not a correlation id")


NUMBER = (int, float)


def number_array(values: list[Any]) -> np.ndarray:
    """Numbers as one array, NaN for a missing value; ValueError when a value is no number (a malformed event)."""
    arr = np.array(values)
    if arr.dtype.kind not in "if":  # a missing value among them, or one that is no number
        if any(v is not None and v.__class__ not in NUMBER for v in values):
            raise ValueError("not a number")
        arr = np.array([math.nan if v is None else v for v in values], dtype=np.float64)
    return arr


def describe(value: Any) -> str:
    text = repr(value)
    kind = type(value).__name__
    return f"{'an' if kind[0] in 'aeiou' else 'a'} {kind} ({text[:40]}{'...' if len(text) > 40 else ''})"


def malformed(batch: list[Any], base: int) -> str:
    """What is wrong with the first malformed event of a batch the read could not take, for the error."""
    for i, e in enumerate(batch):
        if e.__class__ is not dict:
            return f"event {base + i} is not an object"
        ts, dur, cat = e.get("ts"), e.get("dur"), e.get("cat")
        wrong = {}
        if ts is not None and ts.__class__ not in NUMBER:
            wrong["ts"] = f"is {describe(ts)}, not a number"
        if dur is not None and cat is not None and cat != "Trace":
            if dur.__class__ not in NUMBER:
                wrong["dur"] = f"is {describe(dur)}, not a number"
            for key in ("cat", "name"):
                if key not in e or e[key] is None:
                    wrong[key] = "is missing"
                elif e[key].__class__ is not str:
                    wrong[key] = f"is {describe(e[key])}, not a string"
            a = e.get("args")
            if a.__class__ is dict:
                corr, nbytes = a.get("correlation"), a.get("bytes")
                if corr is not None and corr.__class__ is not int and not (corr.__class__ is float
                                                                           and corr.is_integer()):
                    wrong["args.correlation"] = f"is {describe(corr)}, not an integer"
                if nbytes is not None and nbytes.__class__ not in NUMBER:
                    wrong["args.bytes"] = f"is {describe(nbytes)}, not a number"
        if wrong:
            return f"event {base + i}: " + "; ".join(f"{k} {v}" for k, v in wrong.items())
    return "an event's fields are not of the types a trace has"
