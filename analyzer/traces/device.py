"""Which kind of device a trace comes from (CUDA, ROCm/HIP, MTIA, CPU only) and whether it has a kernel timeline.

Judged from the runtime calls on the CPU (cuda*/cu*, hip*, mtia*), the event categories and deviceProperties.
A trace with runtime calls or device properties but no device activity has no kernel timeline: a CUPTI
counter-mode capture (cuda_profiler_range events) or a profiler run without the device activity.
"""

from __future__ import annotations

import re
from typing import Any

from analyzer.traces.parse import GPU_CATS, ParsedTrace

KINDS = ("cuda", "rocm", "mtia", "cpu", "unknown")
LABELS = {"cuda": "CUDA (NVIDIA)", "rocm": "ROCm/HIP (AMD)", "mtia": "MTIA (Meta)", "cpu": "CPU only",
          "unknown": "unknown device"}
RUNTIME = {"cuda": re.compile(r"^(cuda|cu)[A-Z]"), "rocm": re.compile(r"^hip[A-Z]"),
           "mtia": re.compile(r"^mtia", re.IGNORECASE)}
NAME = {"cuda": re.compile(r"NVIDIA|Tesla|GeForce|Quadro", re.IGNORECASE),
        "rocm": re.compile(r"AMD|Radeon|Instinct|MI\d{3}", re.IGNORECASE),
        "mtia": re.compile(r"MTIA", re.IGNORECASE)}
COUNTER_CATS = {"cuda_profiler_range"}


def device_kind(t: ParsedTrace) -> dict[str, Any]:
    """{"kind", "label", "name", "why", "kernel_timeline", "no_timeline_reason"} for one rank's trace."""
    df = t.df
    cats = set(t.facts["cats"])
    names = sorted(t.facts["cpu_names"])
    props = t.meta.get("deviceProperties") or []
    dev_name = t.device_name
    votes = {k: sum(1 for n in names if rx.match(n)) for k, rx in RUNTIME.items()}
    if any("mtia" in c.lower() for c in cats):
        votes["mtia"] += 1000
    kind, why = "unknown", ""
    if dev_name and any(rx.search(dev_name) for rx in NAME.values()):
        kind = next(k for k, rx in NAME.items() if rx.search(dev_name))
        why = f"deviceProperties name {dev_name!r}"
    elif max(votes.values()) > 0:
        kind = max(votes, key=votes.get)
        why = f"{votes[kind]} {kind} runtime call names on the CPU"
    timeline = bool((df["stream"].ge(0) & df["s_cat"].isin(GPU_CATS)).any())
    if kind == "unknown" and not timeline and not props and not (cats & COUNTER_CATS):
        kind, why = "cpu", "no device events, no device runtime calls, no deviceProperties"
    reason = None
    if not timeline and kind != "cpu":
        if cats & COUNTER_CATS:
            reason = "no kernel timeline: this trace was captured with CUPTI counters only (cuda_profiler_range)"
        else:
            reason = ("no kernel timeline: the profiler recorded no device activity (add ProfilerActivity.CUDA, "
                      "or the device's activity, to torch.profiler's activities)")
    if kind == "unknown" and not why:
        why = "device events, but no known runtime call names and no deviceProperties"
    return {"kind": kind, "label": LABELS[kind], "name": dev_name, "why": why, "kernel_timeline": timeline,
            "no_timeline_reason": reason}
