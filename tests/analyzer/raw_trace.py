"""Test helper: figures computed straight from a trace's raw JSON events, in plain Python, to check the analyzer by.

Nothing here uses the analyzer or HTA: step windows are the ProfilerStep#N spans, device events are the
kernel / gpu_memcpy / gpu_memset events, communication kernels are those named nccl*, and busy time is the
union of intervals clipped to the step windows.
"""

from __future__ import annotations

import gzip
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import TRACES

DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset", "Kernel", "Memcpy", "Memset"}
STEP = re.compile(r"^ProfilerStep#(\d+)$")


@dataclass
class Raw:
    events: list[dict]
    meta: dict

    @property
    def steps(self) -> list[tuple[float, float]]:
        seen: dict[int, tuple[float, float]] = {}
        for e in self.events:
            m = STEP.match(str(e.get("name", "")))
            if m and e.get("ph") == "X" and e.get("cat") in ("user_annotation", "cpu_op"):
                seen.setdefault(int(m.group(1)), (float(e["ts"]), float(e["ts"]) + float(e["dur"])))
        return sorted(seen.values())

    def device(self, kind: str | None = None) -> list[dict]:
        """Device events; kind: 'comm' (nccl kernels), 'comp' (other kernels), 'memory' (copies, memsets)."""
        out = []
        for e in self.events:
            if e.get("ph") != "X" or e.get("cat") not in DEVICE_CATS:
                continue
            is_kernel = e["cat"] in ("kernel", "Kernel")
            is_comm = is_kernel and "nccl" in e["name"].lower()
            k = "comm" if is_comm else "comp" if is_kernel else "memory"
            if kind is None or kind == k:
                out.append(e)
        return out

    def cpu(self, name: str) -> list[dict]:
        return [e for e in self.events if e.get("ph") == "X" and e.get("name") == name
                and e.get("cat") not in DEVICE_CATS]


def load(name: str | Path) -> Raw:
    path = Path(name) if Path(name).is_absolute() else TRACES / name
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rb") as fh:
        record = json.loads(fh.read())
    events = record.pop("traceEvents")
    return Raw(events, record)


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
    merged = union(intervals)
    total = 0.0
    for w0, w1 in windows:
        for s, e in merged:
            total += max(0.0, min(e, w1) - max(s, w0))
    return total
