"""A device's share of a whole GPU: 1 for a GPU, less for a MIG slice, so that GPU-hours held count what was held.

A MIG device's name is its parent's model and its profile ("NVIDIA A100-SXM4-80GB MIG 1g.10gb": NVML names MIG
devices so, and fleetlens's dcgm-exporter importer too). A profile `<g>g.<m>gb` (or a compute instance's
`<c>c.<g>g.<m>gb`) holds g of the GPU's compute slices: 7 on the A100, H100, H200 and Blackwell GPUs, 4 on the A30.
Without a profile, the slice's memory against the parent's (from the model name, "80GB") stands in; without either,
the device counts whole (the conservative choice: held hours are never made up smaller than they may be).
"""

from __future__ import annotations

import re
from functools import lru_cache

_PROFILE = re.compile(r"\bMIG\s+(?:\d+c\.)?(\d+)g\.(\d+)gb", re.IGNORECASE)
_MODEL_MEMORY = re.compile(r"(\d+)\s*GB\b", re.IGNORECASE)
GIB = 1 << 30
SLICES_A30 = 4
SLICES = 7


@lru_cache(maxsize=65536)
def share_of(name: str | None, memory_total: float | None = None) -> float:
    """The device's share of its GPU, in (0, 1]."""
    if not name or "MIG" not in name.upper():
        return 1.0
    found = _PROFILE.search(name)
    slices = SLICES_A30 if re.search(r"\bA30\b", name) else SLICES
    if found:
        return min(1.0, max(int(found.group(1)), 1) / slices)
    parent = _MODEL_MEMORY.search(name.split("MIG", 1)[0])
    if parent and memory_total and memory_total > 0:
        return min(1.0, float(memory_total) / (int(parent.group(1)) * GIB))
    return 1.0
