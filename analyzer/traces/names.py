"""Event names the questions pick out: tensor-core and matmul kernels, synchronising calls, kernel launches, copy
calls (and which of them issued which device copies)."""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

# Tensor-core kernels by name: NVIDIA HMMA/IMMA paths (xmma, *_tensorop, sm80+ cutlass/cuBLASLt, wgmma, tf32/fp16
# gemm variants, flash attention), cuBLASLt's nvjet GEMMs (CUDA 12.8+ on Hopper and Blackwell: warpgroup-MMA kernels
# such as "nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_NNT") and AMD MFMA (rocBLAS/Tensile "Cijk_..._MI<m>x<n>x<k>").
TENSOR_CORE_RE = re.compile(
    r"xmma|hmma|imma|wgmma|tensorop|_s1688|_h1688|_s16816|_h16816|_i8816|sm8\d_|sm9\d_|cutlass.*(?:tf32|f16|bf16)"
    r"|gemm.*(?:tf32|fp16|bf16|f16|_h\d)|flash_?(?:fwd|bwd|attn)|fmha|nvjet|_MI\d+x\d+x\d+",
    re.IGNORECASE,
)
# ... unless the name says the kernel multiplies with plain FP32 FMA instructions (SIMT): cuBLAS/cuDNN's FP32 xmma
# kernels on Ampere and Hopper ("sm80_xmma_gemm_f32f32_f32f32_f32_..._ffma_...") and CUTLASS's simt kernels; these
# are what TF32 or AMP would move onto the tensor cores (TF32 ones read "tf32f32_tf32f32_f32"). An nvjet kernel names
# its types after "nvjet_" (optionally "sm<NN>_"), one letter each: h FP16, t BF16, s FP32, q FP8 ("hsh": FP16 in
# and out, FP32 accumulate; "tst": BF16 with FP32 accumulate); an all-FP32 one computes in TF32 on the tensor cores
# only when the name says so ("nvjet_sss_tf32_..."): without it, it is FP32 the tensor cores do not run
NVJET_FP32_RE = r"nvjet_(?:sm\d+_)?s+_(?!.*tf32)"
NOT_TENSOR_CORE_RE = re.compile(rf"ffma|simt|(?<!t)f32f32_f32f32_f32|{NVJET_FP32_RE}", re.IGNORECASE)
# Kernels that do matrix multiplies or convolutions: where tensor cores apply at all (every nvjet kernel is a GEMM)
MATMUL_RE = re.compile(r"(?<!fb)gemm|gemv|conv|fprop|dgrad|wgrad|matmul|Cijk_|xmma|cutlass|fmha|flash|nvjet",
                       re.IGNORECASE)
SYNC_NAMES = {
    "cudaStreamSynchronize": "stream_sync",
    "hipStreamSynchronize": "stream_sync",
    "cudaDeviceSynchronize": "device_sync",
    "hipDeviceSynchronize": "device_sync",
    "cudaEventSynchronize": "event_sync",
    "hipEventSynchronize": "event_sync",
    "mtiaStreamSynchronize": "stream_sync",
    "mtiaDeviceSynchronize": "device_sync",
    "mtiaEventSynchronize": "event_sync",
    "aten::item": "item",
    "aten::_local_scalar_dense": "local_scalar_dense",
}
# Kernel launch calls: CUDA runtime (cudaLaunchKernel, cudaLaunchKernelExC) and driver (cuLaunchKernel,
# cuLaunchKernelEx: Triton), HIP (hipLaunchKernel, hipExtLaunchKernel, and hipModuleLaunchKernel /
# hipExtModuleLaunchKernel: Triton and rocBLAS on ROCm), graph launches and cooperative launches
LAUNCH_RE = re.compile(
    r"(cuda|hip|cu|hipExt|hipModule|hipExtModule|mtia)LaunchKernel|cudaLaunchKernelExC|(cuda|cu|hip)GraphLaunch"
    r"|LaunchCooperative"
)


def kernel_label(name: str) -> str:
    """A kernel's name as a report shows it on one line: its demangled signature without the return type and the
    parameter list, template arguments kept (two instances of one template are different kernels).
    "void at::native::(anonymous namespace)::CatArrayBatchedCopy<float, unsigned int, 4, 64, 64>(...)" reads
    "at::native::(anonymous namespace)::CatArrayBatchedCopy<float, unsigned int, 4, 64, 64>"."""
    label = name.strip()
    if label.startswith("void "):
        label = label[5:].lstrip()
    depth = 0
    i = 0
    while i < len(label):
        c = label[i]
        if c == "<":
            depth += 1
        elif c == ">" and depth:
            depth -= 1
        elif c == "(" and depth == 0:
            if label.startswith("(anonymous namespace)", i):
                i += len("(anonymous namespace)")
                continue
            # a lambda's call operator is part of the name
            if i >= len("operator") and label.startswith("operator()", i - len("operator")):
                i += 2
                continue
            return label[:i].rstrip() or name
        i += 1
    return label or name


# the device's copies (Kineto's categories), and the runtime calls on the CPU that issue them: cudaMemcpyAsync,
# hipMemcpyWithStream, mtiaMemcpyAsync, cuMemcpyHtoD
COPY_CATS = ("gpu_memcpy", "Memcpy")
MEMCPY_CALL_RE = re.compile(r"^(?:cuda|hip|mtia|cu)Memcpy")


def issuing_calls(copy_name: np.ndarray, copy_corr: np.ndarray, call_name: np.ndarray, call_corr: np.ndarray,
                  table: Sequence[str]) -> dict[str, list[str]]:
    """Which copy calls issued each kind of device copy, joined by correlation id (Kineto gives a device event the id
    of the runtime call that launched it): copy event name -> the calls' names, sorted.

    Names are codes into `table`; `call_*` are the copy calls on the CPU (MEMCPY_CALL_RE) in file order, the last of
    an id winning as in HTA's join. Only copy names whose events carry a correlation id are keys: a trace without ids
    tells nothing here (an empty list says the ids match no copy call read)."""
    has = copy_corr >= 0
    out: dict[str, list[str]] = {str(table[c]): [] for c in np.unique(copy_name[has])}
    if not out or not len(call_corr):
        return out
    ids, first_from_end = np.unique(call_corr[::-1], return_index=True)
    names = call_name[len(call_corr) - 1 - first_from_end]  # the last call read with each id
    pos = np.clip(np.searchsorted(ids, copy_corr), 0, len(ids) - 1)
    hit = has & (ids[pos] == copy_corr)
    for c, n in np.unique(np.stack([copy_name[hit], names[pos[hit]]]).astype(np.int64), axis=1).T:
        out[str(table[c])].append(str(table[n]))
    return {k: sorted(v) for k, v in out.items()}
