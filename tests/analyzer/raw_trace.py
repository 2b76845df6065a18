"""Test helper: figures computed straight from a trace's raw JSON events, in plain Python, to check the analyzer by.

Nothing here uses the analyzer or HTA: step windows are the ProfilerStep#N spans, device events are the
kernel / gpu_memcpy / gpu_memset events, communication kernels are those named nccl*, and busy time is the
union of intervals clipped to the step windows.

A shared trace (a name under tests/conftest.TRACES) is read once per test session: `load` hands every test the
same Raw, read-only all through (its events a tuple, every JSON object a ReadOnlyDict), so no test can change
what the next one reads. A test that edits a trace takes its own copy with `load_copy`; a trace the test wrote
itself (an absolute path) is read afresh each time, editable.
"""

from __future__ import annotations

import bisect
import gzip
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import TRACES

DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset", "Kernel", "Memcpy", "Memset"}
STEP = re.compile(r"^ProfilerStep#(\d+)$")


class ReadOnlyDict(dict):
    """A JSON object of a shared trace: readable (and JSON-serialisable) as a dict, never changed."""

    def _read_only(self, *_args, **_kwargs):
        raise TypeError("a shared trace's events are read-only: take your own with raw_trace.load_copy")

    __setitem__ = __delitem__ = __ior__ = _read_only
    clear = pop = popitem = setdefault = update = _read_only

    def __copy__(self) -> dict:
        return dict(self)

    def __deepcopy__(self, memo: dict) -> dict:
        return json.loads(json.dumps(self))

    def __reduce__(self):
        return dict, (dict(self),)


@dataclass
class Raw:
    events: list[dict] | tuple[dict, ...]
    meta: dict
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def steps(self) -> list[tuple[float, float]]:
        if "steps" not in self._memo or self._editable:
            seen: dict[int, tuple[float, float]] = {}
            for e in self.events:
                m = STEP.match(str(e.get("name", "")))
                if m and e.get("ph") == "X" and e.get("cat") in ("user_annotation", "cpu_op"):
                    seen.setdefault(int(m.group(1)), (float(e["ts"]), float(e["ts"]) + float(e["dur"])))
            self._memo["steps"] = sorted(seen.values())
        return list(self._memo["steps"])

    @property
    def _editable(self) -> bool:
        """Worked-out figures are kept only for a read-only trace: an editable one may change under them."""
        return not isinstance(self.events, tuple)

    def device(self, kind: str | None = None) -> list[dict]:
        """Device events; kind: 'comm' (nccl kernels), 'comp' (other kernels), 'memory' (copies, memsets)."""
        key = ("device", kind)
        if key not in self._memo or self._editable:
            out = []
            for e in self.events:
                if e.get("ph") != "X" or e.get("cat") not in DEVICE_CATS:
                    continue
                is_kernel = e["cat"] in ("kernel", "Kernel")
                is_comm = is_kernel and "nccl" in e["name"].lower()
                k = "comm" if is_comm else "comp" if is_kernel else "memory"
                if kind is None or kind == k:
                    out.append(e)
            self._memo[key] = out
        return list(self._memo[key])

    def cpu(self, name: str) -> list[dict]:
        return [e for e in self.events if e.get("ph") == "X" and e.get("name") == name
                and e.get("cat") not in DEVICE_CATS]


def _read(path: Path, read_only: bool) -> Raw:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rb") as fh:
        record = json.loads(fh.read(), object_pairs_hook=ReadOnlyDict if read_only else None)
    if not read_only:
        events = record.pop("traceEvents")
        return Raw(events, record)
    meta = ReadOnlyDict((k, v) for k, v in record.items() if k != "traceEvents")
    return Raw(tuple(record["traceEvents"]), meta)


_SHARED: dict[Path, Raw] = {}


def _path(name: str | Path) -> Path:
    return Path(name) if Path(name).is_absolute() else TRACES / name


def load(name: str | Path) -> Raw:
    """The trace's events; a shared trace (a name under TRACES) read once per session and read-only."""
    path = _path(name)
    if path.parent != TRACES:
        return _read(path, read_only=False)
    if path not in _SHARED:
        _SHARED[path] = _read(path, read_only=True)
    return _SHARED[path]


def load_copy(name: str | Path) -> Raw:
    """The trace's events read afresh from its file, the test's own to edit."""
    return _read(_path(name), read_only=False)


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return [(s, e) for s, e in merged]


def length(intervals: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in union(intervals))


def spans(events: list[dict], hta_rounding: bool = True) -> list[tuple[float, float]]:
    """(start, end) of each event. HTA (whose parser we use) shrinks nanosecond-resolution events to whole
    microseconds, start rounded up and end down, because the profiler's rounding lets events overlap; with
    hta_rounding the hand figures do the same, without it they are the raw floats."""
    if not hta_rounding:
        return [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events]
    out = []
    for e in events:
        ts, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        if isinstance(e["ts"], float):
            ts, end = math.ceil(ts), math.floor(end)
        out.append((ts, end))
    return out


def inside(intervals: list[tuple[float, float]], windows: list[tuple[float, float]]) -> float:
    """Length of the union of intervals that lies inside the windows."""
    # an interval HTA's rounding turned inside out (end before start: a sub-microsecond event) covers nothing; the
    # rest of the union is disjoint and in order, so each window needs only the intervals from the first ending
    # after it starts (by bisection) to the last starting before it ends
    merged = [(s, e) for s, e in union(intervals) if e > s]
    ends = [e for _, e in merged]
    total = 0.0
    for w0, w1 in windows:
        for k in range(bisect.bisect_right(ends, w0), len(merged)):
            s, e = merged[k]
            if s >= w1:
                break
            total += max(0.0, min(e, w1) - max(s, w0))
    return total
