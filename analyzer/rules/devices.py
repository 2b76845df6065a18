"""What a rule can judge on which device, and the words of that device's API its advice is written in.

Each rule writes its advice from `device_api(summary)`: the device's name, its graph capture (CUDA graphs, HIP graphs;
none on MTIA and CPU, where torch.compile is what applies), its synchronize and event calls and its collectives
library, so no advice names a CUDA call on a device that has none. A rule that cannot judge a trace (no kernel
timeline, no device at all, kernel names it cannot read, copies whose host memory the trace does not name) says why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

NEEDS_TIMELINE = ("trace.host_bound", "trace.launch_bound", "trace.pageable_memcpy", "trace.pageable_dtoh",
                  "trace.no_tensor_cores", "trace.comm_overlap")
TENSOR_CORE_KINDS = ("cuda", "rocm")
# the copy rules judge the host memory a copy's name gives (Kineto: "Memcpy HtoD (Pageable -> Device)"). ROCm's
# tracers (roctracer, rocprofiler) name it "Host" from the copy's direction alone, pageable and pinned alike, and the
# copy call's own record holds only pointers, a size and a hipMemcpyKind: such a trace cannot tell the two apart
HOST_MEMORY_RULES = {"trace.pageable_memcpy": ("HtoD", "host-to-device"),
                     "trace.pageable_dtoh": ("DtoH", "device-to-host")}


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
        elif rule in HOST_MEMORY_RULES and (n := unknown_host_copies(summary, HOST_MEMORY_RULES[rule][0])):
            out[rule] = (f"the copy kind is unknown on this device: its {n} {HOST_MEMORY_RULES[rule][1]} copies name "
                         f"their host memory 'Host', pageable or pinned alike ({label} traces do not record which)")
    return out


def unknown_host_copies(summary: dict[str, Any], direction: str) -> int:
    """How many copies of `direction` name their host memory only as "Host" (ROCm), when none names it pageable or
    pinned; 0 when the trace tells them apart."""
    rows = [r for r in summary.get("memcpy") or [] if r["direction"] == direction]
    if any(r["host_memory"] in ("pageable", "pinned") for r in rows):
        return 0
    return sum(r["count"] for r in rows if r["host_memory"] == "host")
