"""A MIG device's share of its parent GPU, from NVML without privileges.

nvmlDeviceGetAttributes answers for MIG device handles only ("This API currently only supports MIG device
handles"), so the whole GPU's SMs, slices and memory come from its largest GPU-instance profile, which NVML gives for
the parent to any caller; the parent's own memory figure, which in MIG mode needs privileges, is the last resort.
"""

from __future__ import annotations

from typing import Any

MIB = 1 << 20  # NVML's "MB" (memorySizeMB) are MiB


def whole_gpu_profile(nv: Any, parent: Any) -> Any:
    """The parent GPU's GPU-instance profile with the most slices (7g on an A100, 4g on an A30): the whole GPU's SMs,
    slices and memory. None where the driver answers for no profile."""
    best = None
    version = 2
    for profile in range(int(getattr(nv, "NVML_GPU_INSTANCE_PROFILE_COUNT", 0))):
        try:
            info = nv.nvmlDeviceGetGpuInstanceProfileInfo(parent, profile, version)
        except nv.NVMLError as exc:
            if version == 2 and getattr(exc, "value", None) == nv.NVML_ERROR_FUNCTION_NOT_FOUND:
                version = 1  # a driver before the V call: the v1 struct has the same fields we read
                try:
                    info = nv.nvmlDeviceGetGpuInstanceProfileInfo(parent, profile, version)
                except nv.NVMLError:
                    continue
            else:
                continue  # a profile this GPU does not have
        except AttributeError:
            break
        if best is None or (info.sliceCount, info.multiprocessorCount) > (best.sliceCount, best.multiprocessorCount):
            best = info
    return best


def slice_weight(nv: Any, handle: Any, parent: Any, total: int | None, whole: Any) -> float | None:
    """The MIG device `handle`'s share of `parent` (whose largest profile is `whole`): its SMs over the whole GPU's,
    else its GPU-instance slices over the whole GPU's, else its memory (`total` bytes) over the whole GPU's."""
    try:
        mine = nv.nvmlDeviceGetAttributes(handle)
    except (nv.NVMLError, AttributeError):
        mine = None
    if mine is not None and whole is not None:
        for part, of in ((mine.multiprocessorCount, whole.multiprocessorCount),
                         (mine.gpuInstanceSliceCount, whole.sliceCount)):
            if 0 < int(part) <= int(of):
                return int(part) / int(of)
    parent_total = int(whole.memorySizeMB) * MIB if whole is not None else 0
    if not parent_total:
        try:
            parent_total = int(nv.nvmlDeviceGetMemoryInfo(parent).total)
        except nv.NVMLError:
            return None
    return None if not total or not parent_total else min(1.0, total / parent_total)
