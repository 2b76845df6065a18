"""C, the memory a job's process holds outside PyTorch's caching allocator, measured where both halves meet: the agent.

NVML's per-process used memory (the agent's sampler) counts everything the process holds on the device: its CUDA
context, cuDNN / cuBLAS / NCCL workspaces, and the caching allocator's reserved segments. The job SDK reports
torch.cuda.memory_reserved() with each step batch (`mem_reserved`). The difference of two readings of one process
taken close together is C, what admission charges beside the process's lane (enforcer.lanes) and no memory
fraction caps (collector.launch).

The two readings are not taken at the same instant. A job alone on its device keeps its reserved segments once
warm, so any pair is exact; a lane job gives its ephemeral memory back at each turn's end, so a pair may straddle
a change of up to E either way. Each process keeps the median of its last `KEEP` pairs, which such errors, falling
both ways, do not move far; a workflow's C is the largest over its processes.
"""

from __future__ import annotations

import statistics
from collections import deque

PAIR_WINDOW_S = 5.0  # two readings further apart than this are not paired
KEEP = 15  # pairs kept per process
MAX_UNPAIRED = 4096  # NVML readings kept before old ones (no SDK report near them) are dropped


class ContextMeter:
    """Pairs NVML's and the allocator's readings per process. Not thread-safe: the caller holds its lock."""

    def __init__(self, window_s: float = PAIR_WINDOW_S) -> None:
        if window_s <= 0:
            raise ValueError(f"the pairing window must be > 0 s, not {window_s}")
        self.window_s = window_s
        self._nvml: dict[int, tuple[float, int]] = {}  # pid -> (ts, used bytes)
        self._reserved: dict[int, tuple[str, float, int]] = {}  # pid -> (workflow, ts, reserved bytes)
        self._paired: dict[int, tuple[float, float]] = {}  # pid -> the (nvml ts, reserved ts) last paired
        self._pairs: dict[tuple[str, int], deque[int]] = {}
        self._ended: dict[str, int] = {}  # workflow -> the largest C of its processes that ended

    def note_nvml(self, pid: int, used: int | None, ts: float) -> str | None:
        """NVML's used memory of a process; the workflow whose C this may have changed, or None."""
        if used is None or used < 0:
            return None
        self._nvml[pid] = (ts, int(used))
        if len(self._nvml) > MAX_UNPAIRED:  # processes that never use the SDK: keep only recent readings
            self._nvml = {k: v for k, v in self._nvml.items() if v[0] >= ts - self.window_s}
        return self._pair(pid)

    def note_reserved(self, workflow: str, pid: int, reserved: int | None, ts: float) -> str | None:
        """The allocator's reserved bytes the SDK reported; the workflow whose C this may have changed, or None."""
        if reserved is None or reserved < 0:
            return None
        self._reserved[pid] = (workflow, ts, int(reserved))
        return self._pair(pid)

    def _pair(self, pid: int) -> str | None:
        nvml, res = self._nvml.get(pid), self._reserved.get(pid)
        if nvml is None or res is None or abs(nvml[0] - res[1]) > self.window_s:
            return None
        if self._paired.get(pid) == (nvml[0], res[1]):
            return None
        self._paired[pid] = (nvml[0], res[1])
        workflow = res[0]
        self._pairs.setdefault((workflow, pid), deque(maxlen=KEEP)).append(max(0, nvml[1] - res[2]))
        return workflow

    def process_context(self, workflow: str, pid: int) -> int | None:
        pairs = self._pairs.get((workflow, pid))
        return int(statistics.median_low(pairs)) if pairs else None

    def workflow_context(self, workflow: str) -> int | None:
        """C of the workflow's processes, those that ended here too: the largest of their medians (None: never
        measured)."""
        values = [self.process_context(wf, pid) for wf, pid in self._pairs if wf == workflow]
        values.append(self._ended.get(workflow))
        return max((v for v in values if v is not None), default=None)

    def forget(self, pid: int) -> None:
        """Drop a process that ended (its pid may be reused); its workflow's figure stays as measured, its median
        kept as one figure per workflow (`forget_workflow` drops it)."""
        self._nvml.pop(pid, None)
        self._reserved.pop(pid, None)
        self._paired.pop(pid, None)
        for key in [k for k in self._pairs if k[1] == pid]:
            median = self.process_context(*key)
            del self._pairs[key]
            if median is not None:
                self._ended[key[0]] = max(self._ended.get(key[0], median), median)

    def forget_workflow(self, workflow: str) -> None:
        """Drop what is kept of a workflow none of whose processes runs here any more (its figure is in the store)."""
        self._ended.pop(workflow, None)
        for key in [k for k in self._pairs if k[0] == workflow]:
            del self._pairs[key]
