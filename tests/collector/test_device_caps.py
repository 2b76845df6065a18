"""The SDK's CUDA memory cap holds on every device the job's process uses (collector.device_caps), not only on the
one current when it started, and creates no CUDA context on a device the process does not use. Against a stand-in
for torch.cuda that records each cap by device, since this machine has no GPU (the `gpu` tests run the real
thing)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from collector.device_caps import DeviceCaps
from collector.job import job
from store.settings import Settings


class FakeCuda:
    """torch.cuda's calls the SDK makes: caps by device; a context exists where CUDA was initialised or capped."""

    def __init__(self, devices: int) -> None:
        self.devices = devices
        self.initialized = False
        self.current = 0
        self.reserved: dict[int, int] = {}
        self.caps: dict[int, float] = {}
        self.contexts: set[int] = set()

    def _init(self, device: int) -> None:
        self.initialized = True
        self.contexts.add(device)

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return self.initialized

    def device_count(self) -> int:
        return self.devices

    def current_device(self) -> int:
        return self.current

    def set_device(self, device: int) -> None:
        self.current = device

    def allocate(self, nbytes: int) -> None:  # what the job's own code does
        self._init(self.current)
        self.reserved[self.current] = self.reserved.get(self.current, 0) + nbytes

    def memory_reserved(self, device: int | None = None) -> int:  # the allocator's figure: no context
        return self.reserved.get(self.current if device is None else device, 0)

    def set_per_process_memory_fraction(self, fraction: float, device: int | None = None) -> None:
        assert isinstance(fraction, float)
        device = self.current if device is None else device
        self._init(device)  # as torch's allocator may: it asks the device for its total memory
        self.caps[device] = fraction

    def reset_peak_memory_stats(self) -> None:
        pass

    def memory_allocated(self) -> int:
        return self.reserved.get(self.current, 0)

    def max_memory_reserved(self) -> int:
        return self.reserved.get(self.current, 0)

    def empty_cache(self) -> None:
        pass


def test_each_device_is_capped_as_the_process_starts_using_it() -> None:
    cuda = FakeCuda(4)
    caps = DeviceCaps(SimpleNamespace(cuda=cuda), 0.5)
    caps.apply()  # CUDA not initialised yet: nothing capped, and no context made
    assert cuda.caps == {} and cuda.contexts == set()
    cuda.set_device(2)
    cuda.allocate(1 << 20)
    caps.apply()
    assert cuda.caps == {2: 0.5} and cuda.contexts == {2}  # not device 0: no context there
    cuda.set_device(3)  # a second device of the job's, e.g. shards on two GPUs
    caps.apply()
    assert cuda.caps == {2: 0.5, 3: 0.5}
    cuda.set_device(2)
    cuda.reserved[0] = 1 << 20  # memory on a device it never made current (a tensor moved there)
    caps.apply()
    assert cuda.caps == {0: 0.5, 2: 0.5, 3: 0.5}
    cuda.caps.clear()
    caps.apply()
    assert cuda.caps == {}  # each device once: a lane's turns switch its cap after that
    lane = FakeCuda(1)
    DeviceCaps(SimpleNamespace(cuda=lane), 0.25).apply(initialise=True)  # a lane job: its one device at once
    assert lane.caps == {0: 0.25}


def test_a_job_is_capped_on_its_device_at_start_and_on_each_other_device_it_comes_to_use(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = FakeCuda(3)
    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(cuda=cuda))
    settings = Settings(home=tmp_path / "home", sdk_retry_s=3600).model_copy(update={"memory_fraction": 0.5})
    with job("two-gpus", total_steps=3, workflow="sharded", settings=settings) as j:
        assert j.memory_fraction_applied == 0.5 and cuda.caps == {0: 0.5}  # before the job allocates anything
        cuda.allocate(1 << 30)
        cuda.set_device(1)  # the job's second GPU, e.g. shards on two GPUs or a model split over two
        cuda.allocate(1 << 30)
        for _ in j.steps():
            assert cuda.caps == {0: 0.5, 1: 0.5}  # capped before the first step allocates more
    assert cuda.contexts == {0, 1}  # never a context on the device the job does not use
