"""Whether a managed job died out of GPU memory: what PyTorch and CUDA print, in its log since its last start."""

from __future__ import annotations

from pathlib import Path

START_MARK = "--- fleetlens: starting"  # the line the agent writes into a job's log before each start

OUT_OF_MEMORY_MARKERS = ("CUDA out of memory", "torch.OutOfMemoryError", "torch.cuda.OutOfMemoryError",
                         "CUDA error: out of memory")


def ran_out_of_memory(log_path: Path, tail_bytes: int = 64 * 1024) -> bool:
    """Whether the end of a job's log, since its last start, shows it died out of GPU memory (with or without the
    job SDK: the markers are what PyTorch and CUDA print)."""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - tail_bytes))
            tail = f.read().decode(errors="replace")
    except OSError:
        return False
    tail = tail.rsplit(START_MARK, 1)[-1]  # an earlier run's failure is not this one's
    return any(marker in tail for marker in OUT_OF_MEMORY_MARKERS)

