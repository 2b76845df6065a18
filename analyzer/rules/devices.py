"""What a rule can judge on which device, and its advice in the words of that device's API.

The rules' fixes are written for CUDA; on ROCm/HIP and MTIA the same advice names that stack's calls.
A rule that cannot judge a trace (no kernel timeline, no device at all, kernel names it cannot read) says why.
"""

from __future__ import annotations

from typing import Any

NEEDS_TIMELINE = ("trace.host_bound", "trace.launch_bound", "trace.pageable_memcpy", "trace.pageable_dtoh",
                  "trace.no_tensor_cores", "trace.comm_overlap")
TENSOR_CORE_KINDS = ("cuda", "rocm")

ROCM = [
    ("torch.cuda.synchronize()", "torch.cuda.synchronize() (hipDeviceSynchronize on ROCm)"),
    ("CUDA graphs", "HIP graphs (torch.cuda.graphs on ROCm)"),
    ("replay the step as a CUDA graph", "replay the step as a HIP graph"),
    ("NCCL_DEBUG=INFO", "NCCL_DEBUG=INFO (read by RCCL)"),
    ("torch.cuda.Event()", "torch.cuda.Event() (a HIP event on ROCm)"),
]
MTIA = [
    ("torch.cuda.synchronize()", "torch.mtia.synchronize()"),
    ("capture the step with CUDA graphs / torch.compile", "compile the step with torch.compile"),
    (" (or mode='reduce-overhead' to replay the step as a CUDA graph)", ""),
    ("torch.cuda.Event().synchronize()", "torch.mtia.Event().synchronize()"),
    ("check the interconnect (NCCL_DEBUG=INFO) if collectives are slow",
     "check the interconnect and the MTIA collectives backend if collectives are slow"),
]
ROCM_TENSOR_CORES = (
    "Let matmuls use the matrix cores (MFMA): train with torch.autocast('cuda', dtype=torch.bfloat16) (on ROCm "
    "'cuda' is the AMD GPU), or torch.set_float32_matmul_precision('high') where the GPU has XF32 (MI300); keep "
    "matrix dimensions multiples of 16."
)


def for_device(rule: str, fix: str, kind: str) -> str:
    """The fix as it reads on this kind of device."""
    if kind == "rocm":
        if rule == "trace.no_tensor_cores":
            return ROCM_TENSOR_CORES
        for cuda, hip in ROCM:
            fix = fix.replace(cuda, hip)
    elif kind == "mtia":
        for cuda, mtia in MTIA:
            fix = fix.replace(cuda, mtia)
    return fix


def not_judged(summary: dict[str, Any], rules: list[str]) -> dict[str, str]:
    """Rule -> why it cannot judge this trace (rules not listed can)."""
    dk = summary.get("device_kind") or {}
    kind, label = dk.get("kind", "unknown"), dk.get("label", "unknown device")
    out: dict[str, str] = {}
    for rule in rules:
        if rule in NEEDS_TIMELINE and kind == "cpu":
            out[rule] = "CPU only: this trace has no device, so there is no device time to judge"
        elif rule in NEEDS_TIMELINE and not dk.get("kernel_timeline", summary.get("has_gpu")):
            out[rule] = dk.get("no_timeline_reason") or "no kernel timeline in this trace"
        elif rule == "trace.no_tensor_cores" and kind not in TENSOR_CORE_KINDS:
            out[rule] = (f"tensor-core kernels are known by NVIDIA and AMD kernel names only; this is a {label} "
                         "trace")
        elif rule == "trace.sync_heavy" and kind == "cpu":
            out[rule] = "CPU only: .item() and synchronize calls do not wait for a device here"
    return out
