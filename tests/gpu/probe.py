"""Whether this host can run the `gpu` tests: torch sees a CUDA device and NVML initialises; else why not."""

from __future__ import annotations

from functools import lru_cache

import pynvml


def nvml_init_error() -> pynvml.NVMLError | None:
    """What the real NVML says when asked to start on this machine (None: it starts)."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return exc
    pynvml.nvmlShutdown()
    return None


@lru_cache(maxsize=1)
def gpu_unavailable_reason() -> str | None:
    """None on a GPU host; otherwise the reason the `gpu` tests skip (every missing part named)."""
    # torch loads only when a `gpu` test was collected, so other runs stay light
    import torch

    reasons = []
    error = nvml_init_error()
    if error is not None:
        reasons.append(f"NVML does not initialise ({error})")
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        reasons.append(f"torch.cuda.is_available() is False (torch {torch.__version__}, {build})")
    return "; ".join(reasons) or None
