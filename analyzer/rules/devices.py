"""What a rule can judge on which device, and the words of that device's API its advice is written in.

Each rule writes its advice from `device_api(summary)`: the device's name, its graph capture (CUDA graphs, HIP graphs;
none on MTIA and CPU, where torch.compile is what applies), its synchronize and event calls and its collectives
library, so no advice names a CUDA call on a device that has none. A rule that cannot judge a trace (no kernel
timeline, no device at all, kernel names it cannot read) says why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

NEEDS_TIMELINE = ("trace.host_bound", "trace.launch_bound", "trace.pageable_memcpy", "trace.pageable_dtoh",
                  "trace.no_tensor_cores", "trace.comm_overlap")
TENSOR_CORE_KINDS = ("cuda", "rocm")


@dataclass(frozen=True)
class DeviceApi:
    """The names a rule's advice uses on one kind of device (None: the device has no such thing)."""

    kind: str
    device: str                    # what the advice calls the device
    graph: str | None              # the step captured and replayed as one graph
    synchronize: str               # the call that makes the CPU wait for the device
    event: str                     # an event the CPU waits on instead
    collectives_debug: str         # how to see why collectives are slow
    input_offload: str | None      # a library that decodes and augments batches on the device


DEVICE_APIS = {
    "cuda": DeviceApi("cuda", "GPU", "a CUDA graph", "torch.cuda.synchronize()", "torch.cuda.Event()",
                      "check the interconnect (NCCL_DEBUG=INFO)", "DALI"),
    "rocm": DeviceApi("rocm", "GPU", "a HIP graph (torch.cuda.graphs run as HIP graphs on ROCm)",
                      "torch.cuda.synchronize() (hipDeviceSynchronize on ROCm)",
                      "torch.cuda.Event() (a HIP event on ROCm)",
                      "check the interconnect (RCCL logs with NCCL_DEBUG=INFO)", "rocAL"),
    "mtia": DeviceApi("mtia", "MTIA device", None, "torch.mtia.synchronize()", "torch.mtia.Event()",
                      "check the interconnect and the MTIA collectives backend", None),
    "cpu": DeviceApi("cpu", "CPU", None, "explicit synchronize calls", "an event",
                     "check the network between the hosts (Gloo)", None),
    "unknown": DeviceApi("unknown", "device", None, "the device runtime's synchronize calls",
                         "an event of the device runtime", "check the interconnect and the collectives library",
                         None),
}


def device_api(summary: dict[str, Any]) -> DeviceApi:
    """The API words of the trace's device (CUDA for a summary written before device kinds were told apart)."""
    kind = (summary.get("device_kind") or {}).get("kind", "cuda")
    return DEVICE_APIS.get(kind, DEVICE_APIS["unknown"])


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
