"""Give the memory a finished phase freed back to the system (glibc keeps freed heap pages otherwise).

The streaming reader frees its read buffers and column parts once the frame is built; glibc's malloc keeps those
pages in the process (fragmented among the frame's own), so the analysis that follows grows the process past
them. malloc_trim returns them: on a 1 GB trace the analysis peaked ~20 MiB lower. Elsewhere than glibc it does
nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _trim():  # noqa: ANN202  (a ctypes function, or None)
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


def release_freed_memory() -> None:
    trim = _trim()
    if trim is not None:
        trim(0)
