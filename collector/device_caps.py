"""A job's CUDA memory cap on every device its process uses, not only the one current when the SDK started.

`torch.cuda.set_per_process_memory_fraction` caps one device: the current one when none is named. The SDK caps the
current device when the job starts (before the job's own code allocates anything there), then, before each step,
every other device on which the caching allocator has come to hold memory: a Slurm shard job may hold shards on
several GPUs, and a rank may choose its device (`torch.cuda.set_device(local_rank)`) after the SDK started. It does
not cap every visible device up front: that would create a CUDA context on each (hundreds of MB a device, outside
any cap), and reading the allocator's figures creates none. A rank should still choose its device before the job
starts: the start caps, and so initialises CUDA on, the device current then.
"""

from __future__ import annotations

from typing import Any


class DeviceCaps:
    """The same fraction of each device the process uses (`capped`: the devices capped so far)."""

    def __init__(self, torch: Any, fraction: float) -> None:
        self.torch = torch
        self.fraction = float(fraction)  # set_per_process_memory_fraction takes a float only
        self.capped: set[int] = set()

    def apply(self, *, initialise: bool = False) -> None:
        """Cap the devices in use that are not capped yet. `initialise`: cap the current device even before CUDA is
        initialised (which initialises it): for a process that uses exactly that device."""
        cuda = self.torch.cuda
        if not (initialise or cuda.is_initialized()):
            return
        count = cuda.device_count()
        if len(self.capped) >= count:
            return
        current = cuda.current_device()
        for device in range(count):
            if device not in self.capped and (device == current or cuda.memory_reserved(device) > 0):
                cuda.set_per_process_memory_fraction(self.fraction, device)
                self.capped.add(device)
