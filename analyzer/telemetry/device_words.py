"""The device a telemetry finding is about, told from its Device row, and the words its advice uses for it.

A device's kind comes from the source that registered it: NVML and DCGM (the Prometheus import reads DCGM's
metrics) report NVIDIA GPUs, the cpu source groups of CPU cores; a replayed or Slurm-registered device is an
NVIDIA GPU when its name says so. Any other is an unknown device, and its advice names no vendor's tools or API:
no CUDA graphs, no nvidia-smi on a device that has neither.
"""

from __future__ import annotations

from dataclasses import dataclass

NVIDIA_SOURCES = ("nvml", "prometheus")


@dataclass(frozen=True)
class DeviceWords:
    """The names a telemetry finding's advice uses on one kind of device."""

    kind: str                 # nvidia | cpu | unknown
    device: str               # what the advice calls the device
    small_work: str           # why utilisation overstates use, and what fills the device
    work: str                 # what a trace of it shows running: kernels on a GPU, operators on CPU cores
    leftover_process: str     # how to find the process still holding the device's memory
    reset: str                # what to do when no process is listed


DEVICE_WORDS = {
    "nvidia": DeviceWords(
        "nvidia", "GPU",
        "the kernels are too small to fill the GPU: raise the batch size, fuse kernels (torch.compile) or capture "
        "CUDA graphs", "kernels",
        "`nvidia-smi --query-compute-apps=pid,used_memory --format=csv`", "reset the GPU when none is listed"),
    "cpu": DeviceWords(
        "cpu", "CPU device",
        "the work is too small to keep the cores busy: raise the batch size, or fuse operators (torch.compile) so "
        "fewer, larger ones run", "operators",
        "`ps -eo pid,rss,psr,cmd` lists each process's memory and core",
        "check the cores' affinity when none is listed (a CPU device's memory is its processes' RSS)"),
    "unknown": DeviceWords(
        "unknown", "device",
        "the kernels are too small to fill the device: raise the batch size, fuse kernels (torch.compile), or "
        "capture the step as one graph where the device's runtime offers graphs", "kernels",
        "the device vendor's management tool", "reset the device when none is listed"),
}


def device_kind(source: str | None, name: str | None) -> str:
    """nvidia | cpu | unknown, from the Device row's source and name."""
    name = name.lower() if isinstance(name, str) else ""  # a frame without the column gives NaN
    if source == "cpu" or name.startswith("cpu core"):
        return "cpu"
    if source in NVIDIA_SOURCES or "nvidia" in name:
        return "nvidia"
    return "unknown"


def device_words(source: str | None, name: str | None) -> DeviceWords:
    return DEVICE_WORDS[device_kind(source, name)]
