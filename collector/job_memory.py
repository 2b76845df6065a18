"""A job's device memory per batch of steps: CUDA's persistent and peak bytes, or the process's resident set."""

from __future__ import annotations

from typing import Any


class StepMemory:
    """Tracks what the steps between two flushes held. `torch` given: CUDA (allocator figures, per step); None: the
    CPU (resident memory between steps and the process's high-water mark, a rough stand-in)."""

    def __init__(self, torch: Any = None) -> None:
        self._torch = torch
        self._cuda = torch is not None
        self._mem_persistent: int | None = None
        self._mem_peak: int | None = None

    def begin(self) -> None:
        cuda = self._torch.cuda
        cuda.reset_peak_memory_stats()
        allocated = cuda.memory_allocated()  # what lives across steps: weights, optimizer state, ...
        if self._mem_persistent is None or allocated > self._mem_persistent:
            self._mem_persistent = allocated

    def end(self) -> None:
        # reserved, not allocated: the memory cap counts reserved segments, fragmentation included
        peak = self._torch.cuda.max_memory_reserved()
        if self._mem_peak is None or peak > self._mem_peak:
            self._mem_peak = peak

    def reserved(self) -> int | None:
        """What the caching allocator holds now (CUDA only): with NVML's figure for this process, the agent
        measures the memory outside it (collector.sdk_context)."""
        if not self._cuda:
            return None
        try:
            return int(self._torch.cuda.memory_reserved())
        except Exception:
            return None

    def summary(self) -> tuple[int | None, int | None, str | None]:
        """(persistent, peak, source) for the batch being summarised."""
        if self._cuda:
            result = self._mem_persistent, self._mem_peak, "cuda"
            self._mem_persistent = self._mem_peak = None
            return result if result[0] is not None else (None, None, None)
        try:  # on the CPU: resident memory between steps, and the process's high-water mark
            import resource

            import psutil

            rss = psutil.Process().memory_info().rss
            return rss, max(rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024), "rss"
        except Exception:
            return None, None, None
