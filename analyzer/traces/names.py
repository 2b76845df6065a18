"""Event names the questions pick out: tensor-core and matmul kernels, synchronising calls, kernel launches."""

from __future__ import annotations

import re

# Tensor-core kernels by name: NVIDIA HMMA/IMMA paths (xmma, *_tensorop, sm80+ cutlass/cuBLASLt, wgmma, tf32/fp16
# gemm variants, flash attention) and AMD MFMA (rocBLAS/Tensile "Cijk_..._MI<m>x<n>x<k>").
TENSOR_CORE_RE = re.compile(
    r"xmma|hmma|imma|wgmma|tensorop|_s1688|_h1688|_s16816|_h16816|_i8816|sm8\d_|sm9\d_|cutlass.*(?:tf32|f16|bf16)"
    r"|gemm.*(?:tf32|fp16|bf16|f16|_h\d)|flash_?(?:fwd|bwd|attn)|fmha|_MI\d+x\d+x\d+",
    re.IGNORECASE,
)
# ... unless the name says the kernel multiplies with plain FP32 FMA instructions (SIMT): cuBLAS/cuDNN's FP32 xmma
# kernels on Ampere and Hopper ("sm80_xmma_gemm_f32f32_f32f32_f32_..._ffma_...") and CUTLASS's simt kernels; these
# are what TF32 or AMP would move onto the tensor cores (TF32 ones read "tf32f32_tf32f32_f32")
NOT_TENSOR_CORE_RE = re.compile(r"ffma|simt|(?<!t)f32f32_f32f32_f32", re.IGNORECASE)
# Kernels that do matrix multiplies or convolutions: where tensor cores apply at all
MATMUL_RE = re.compile(r"(?<!fb)gemm|gemv|conv|fprop|dgrad|wgrad|matmul|Cijk_|xmma|cutlass|fmha|flash", re.IGNORECASE)
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
