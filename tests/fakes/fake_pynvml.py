"""A fake NVML at the `pynvml` function boundary: same function names, the real pynvml's errors and constants.

No GPU is here, so tests and benchmarks stand this in for the `pynvml` module. Everything that is not an
NVML *function* (NVMLError and its subclasses, NVML_* constants, ctypes structures such as
c_nvmlGpmMetricsGet_t) is the real pynvml's own object, so `except pynvml.NVMLError_GpuIsLost` behaves exactly
as against a driver. Errors are raised the way pynvml raises them: `pynvml.NVMLError(code)`.

    fake = FakeNVML([FakeGPU(processes=[FakeProcess(pid=123, used_memory=2 << 30, sm_util=40)])])
    monkeypatch.setattr(collector.sources.nvml, "pynvml", fake)

Configure per GPU: metric values (NVML's own units: percent, mW, MHz, bytes), `unsupported` (function names
that raise NotSupported), `denied` (NoPermission), `lost` (every call raises GpuIsLost), `gpm` (metric id ->
percent; None = the GPU has no GPM), pending `xid_events`. `FakeNVML(library_missing=True)` fails nvmlInit the
way a machine without a driver does. `calls` counts every function called (for benchmarks).

Driver generations and odd hardware, as NVML's documentation describes them:
- memory: `memory_used` is what processes allocated, `memory_reserved` what the driver keeps for itself. v1
  (`nvmlDeviceGetMemoryInfo`) reports used = both (nvmlMemory_t: "Sum of Reserved and Allocated"); v2
  (`version=nvmlMemory_v2`) reports them apart. `FakeNVML(memory_v2=False)` is a driver without the v2 call.
- running processes: `FakeNVML(process_api=2)` is a driver without `_v3`; nvidia-ml-py's unversioned call then
  raises NVMLLibraryMismatchError (not an NVMLError), as the real binding's version check does.
- `handle_error` (an NVML error code): nvmlDeviceGetHandleByIndex fails for that GPU (a GPU broken at start-up).
- MIG: `mig=[FakeGPU(...), ...]` turns MIG mode on and makes each entry a MIG device (its own uuid, memory,
  processes, `gpu_instance_id`, `sm_count`, `gpm` activity for its GPU instance). Device and process utilisation
  are not supported on MIG handles, as on the driver. nvmlDeviceGetAttributes answers for MIG handles only
  (`slices`: gpuInstanceSliceCount); the whole GPU's SMs, slices and memory come from its GPU-instance profiles
  (`gi_profiles`). Changing `mig` and calling `reconfigure()` makes every MIG handle handed out so far stale
  (NVML_ERROR_INVALID_ARGUMENT), as destroying instances does.
"""

from __future__ import annotations

import ctypes
from collections import Counter
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml as _real

GiB = 1 << 30


@dataclass
class FakeProcess:
    pid: int
    used_memory: int | None = 1 * GiB  # None: NVML reports "not available" (WDDM, containers)
    sm_util: int | None = None  # percent; None: no utilisation sample for this process


@dataclass
class FakeGPU:
    name: str = "NVIDIA A100-SXM4-80GB"
    uuid: str | None = None  # default GPU-fake-<index>
    memory_total: int = 80 * GiB
    memory_used: int = 0
    gpu_util: int = 0  # percent
    mem_util: int = 0  # percent
    power_mw: int = 60_000
    temperature_c: int = 35
    sm_clock_mhz: int = 1410
    throttle_reasons: int = 0
    ecc_uncorrected: int = 0
    processes: list[FakeProcess] = field(default_factory=list)
    gpm: dict[int, float] | None = None  # metric id -> percent; None: GPM not supported (pre-Hopper)
    unsupported: set[str] = field(default_factory=set)
    denied: set[str] = field(default_factory=set)
    lost: bool = False
    xid_events: list[int] = field(default_factory=list)  # XID codes waiting in the event set
    util_timestamp: int = 1_000_000  # µs; process utilisation samples carry it, bumped by each sample period
    util_period_reads: int = 1  # the driver's sample period ends once every this many reads (1: every read)
    util_reads: int = 0
    memory_reserved: int = 0  # driver/firmware reservation: in v1's `used`, apart in v2
    handle_error: int | None = None  # nvmlDeviceGetHandleByIndex raises NVMLError(this code)
    mig: list[FakeGPU] | None = None  # MIG mode on, with these MIG devices
    gpu_instance_id: int = 0  # a MIG device's GPU instance
    sm_count: int = 108  # multiprocessorCount (a MIG device's nvmlDeviceGetAttributes; a GPU's largest GI profile)
    slices: int = 1  # a MIG device's GPU-instance slices (gpuInstanceSliceCount)
    gi_profiles: dict[int, int] | None = None  # MIG mode: GPU-instance profile id -> slices (None: an A100's)
    compute_mode: int = 0  # NVML_COMPUTEMODE_DEFAULT; nvmlDeviceSetComputeMode changes it (`denied`: no root)


class _Handle:
    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


class _MigHandle:
    __slots__ = ("index", "mig", "generation")

    def __init__(self, index: int, mig: int, generation: int) -> None:
        self.index, self.mig, self.generation = index, mig, generation


class FakeNVML:
    """Stands in for the `pynvml` module."""

    def __init__(
        self,
        gpus: list[FakeGPU] | None = None,
        *,
        library_missing: bool = False,
        driver_missing: bool = False,
        memory_v2: bool = True,
        process_api: int = 3,
    ) -> None:
        self.gpus = list(gpus or [])
        for i, gpu in enumerate(self.gpus):
            if gpu.uuid is None:
                gpu.uuid = f"GPU-fake-{i:04d}"
        self.library_missing = library_missing
        self.driver_missing = driver_missing
        self.memory_v2 = memory_v2
        self.process_api = process_api
        self.generation = 0  # bumped by reconfigure(): MIG handles of an older generation are stale
        self.initialized = 0
        self.calls: Counter[str] = Counter()
        self._handles = [_Handle(i) for i in range(len(self.gpus))]
        # sample address -> (gpu index, or (gpu index, MIG index); -1 before any read, struct kept alive)
        self._gpm_samples: dict[int, tuple[Any, Any]] = {}
        self._registered: set[int] = set()

    # everything that is not a function is the real pynvml's (errors, constants, structures)
    def __getattr__(self, name: str) -> Any:
        if name.startswith("nvml") and callable(getattr(_real, name, None)):
            def missing(*_args: Any, **_kw: Any) -> Any:
                raise _real.NVMLError(_real.NVML_ERROR_FUNCTION_NOT_FOUND)

            return missing
        return getattr(_real, name)

    # ------------------------------------------------------------------------------------ helpers

    def reconfigure(self) -> None:
        """MIG instances were created or destroyed: every MIG handle handed out so far names nothing now."""
        self.generation += 1

    def _gpu(self, fn: str, handle: Any) -> FakeGPU:
        self.calls[fn] += 1
        if not self.initialized:
            raise _real.NVMLError(_real.NVML_ERROR_UNINITIALIZED)
        if isinstance(handle, _MigHandle):
            parent = self.gpus[handle.index]
            if handle.generation != self.generation or not parent.mig or handle.mig >= len(parent.mig):
                raise _real.NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT)
            if parent.lost:
                raise _real.NVMLError(_real.NVML_ERROR_GPU_IS_LOST)
            if fn in ("nvmlDeviceGetUtilizationRates", "nvmlDeviceGetProcessUtilization"):
                raise _real.NVMLError(_real.NVML_ERROR_NOT_SUPPORTED)  # "not currently supported" on MIG
            gpu = parent.mig[handle.mig]
        elif isinstance(handle, _Handle):
            gpu = self.gpus[handle.index]
        else:
            raise _real.NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT)
        if gpu.lost:
            raise _real.NVMLError(_real.NVML_ERROR_GPU_IS_LOST)
        if fn in gpu.unsupported:
            raise _real.NVMLError(_real.NVML_ERROR_NOT_SUPPORTED)
        if fn in gpu.denied:
            raise _real.NVMLError(_real.NVML_ERROR_NO_PERMISSION)
        return gpu

    # ------------------------------------------------------------------------------------ library

    def nvmlInit(self) -> None:
        self.calls["nvmlInit"] += 1
        if self.library_missing:
            raise _real.NVMLError(_real.NVML_ERROR_LIBRARY_NOT_FOUND)
        if self.driver_missing:
            raise _real.NVMLError(_real.NVML_ERROR_DRIVER_NOT_LOADED)
        self.initialized += 1

    def nvmlShutdown(self) -> None:
        self.calls["nvmlShutdown"] += 1
        if not self.initialized:
            raise _real.NVMLError(_real.NVML_ERROR_UNINITIALIZED)
        self.initialized -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        return "550.54.15"

    def nvmlDeviceGetCount(self) -> int:
        self.calls["nvmlDeviceGetCount"] += 1
        if not self.initialized:
            raise _real.NVMLError(_real.NVML_ERROR_UNINITIALIZED)
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        self.calls["nvmlDeviceGetHandleByIndex"] += 1
        if not 0 <= index < len(self.gpus):
            raise _real.NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT)
        if self.gpus[index].handle_error is not None:
            raise _real.NVMLError(self.gpus[index].handle_error)
        return self._handles[index]

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> _Handle:
        self.calls["nvmlDeviceGetHandleByUUID"] += 1
        if not self.initialized:
            raise _real.NVMLError(_real.NVML_ERROR_UNINITIALIZED)
        wanted = uuid.decode() if isinstance(uuid, bytes) else uuid
        for handle, gpu in zip(self._handles, self.gpus, strict=True):
            if gpu.uuid == wanted:
                return handle
        raise _real.NVMLError(_real.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetComputeMode(self, handle: _Handle) -> int:
        return self._gpu("nvmlDeviceGetComputeMode", handle).compute_mode

    def nvmlDeviceSetComputeMode(self, handle: _Handle, mode: int) -> None:
        gpu = self._gpu("nvmlDeviceSetComputeMode", handle)
        if mode not in (_real.NVML_COMPUTEMODE_DEFAULT, _real.NVML_COMPUTEMODE_PROHIBITED,
                        _real.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS):
            raise _real.NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT)
        gpu.compute_mode = mode

    def nvmlDeviceGetIndex(self, handle: _Handle) -> int:
        self._gpu("nvmlDeviceGetIndex", handle)
        return handle.index

    # ------------------------------------------------------------------------------------ device metrics

    def nvmlDeviceGetUUID(self, handle: _Handle) -> str:
        return self._gpu("nvmlDeviceGetUUID", handle).uuid or ""

    def nvmlDeviceGetName(self, handle: _Handle) -> str:
        return self._gpu("nvmlDeviceGetName", handle).name

    def nvmlDeviceGetMemoryInfo(self, handle: _Handle, version: Any = None) -> Any:
        if not version:
            gpu = self._gpu("nvmlDeviceGetMemoryInfo", handle)
            mem = _real.c_nvmlMemory_t()
            used = gpu.memory_used + gpu.memory_reserved  # v1: reserved counts as used
            mem.total, mem.used, mem.free = gpu.memory_total, used, gpu.memory_total - used
            return mem
        gpu = self._gpu("nvmlDeviceGetMemoryInfo_v2", handle)
        if not self.memory_v2:
            raise _real.NVMLError(_real.NVML_ERROR_FUNCTION_NOT_FOUND)  # the driver has no such symbol
        if version != _real.nvmlMemory_v2:
            raise _real.NVMLError(_real.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        mem = _real.c_nvmlMemory_v2_t()
        mem.version, mem.total, mem.reserved = version, gpu.memory_total, gpu.memory_reserved
        mem.used, mem.free = gpu.memory_used, gpu.memory_total - gpu.memory_used - gpu.memory_reserved
        return mem

    def nvmlDeviceGetAttributes(self, handle: Any) -> Any:
        gpu = self._gpu("nvmlDeviceGetAttributes", handle)
        if not isinstance(handle, _MigHandle):  # "This API currently only supports MIG device handles."
            raise _real.NVMLError(_real.NVML_ERROR_NOT_SUPPORTED)
        attrs = _real.c_nvmlDeviceAttributes()
        attrs.multiprocessorCount = gpu.sm_count
        attrs.gpuInstanceSliceCount = gpu.slices
        attrs.memorySizeMB = gpu.memory_total >> 20
        return attrs

    def nvmlDeviceGetGpuInstanceProfileInfo(self, handle: Any, profile: int, version: int = 2) -> Any:
        """A GPU in MIG mode answers for the profiles in its `gi_profiles` (an A100's by default: 1, 2, 3, 4 and 7
        slices, each slice a seventh of the SMs and an eighth of the memory, the 7-slice profile all of both);
        NVML_ERROR_NOT_SUPPORTED for any other, and for a GPU not in MIG mode."""
        if isinstance(handle, _MigHandle):
            raise _real.NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT)
        gpu = self._gpu("nvmlDeviceGetGpuInstanceProfileInfo", handle)
        if version == 2 and "nvmlDeviceGetGpuInstanceProfileInfoV" in gpu.unsupported:
            raise _real.NVMLError(_real.NVML_ERROR_FUNCTION_NOT_FOUND)  # a driver before the V call
        profiles = gpu.gi_profiles if gpu.gi_profiles is not None else {
            _real.NVML_GPU_INSTANCE_PROFILE_1_SLICE: 1, _real.NVML_GPU_INSTANCE_PROFILE_2_SLICE: 2,
            _real.NVML_GPU_INSTANCE_PROFILE_3_SLICE: 3, _real.NVML_GPU_INSTANCE_PROFILE_4_SLICE: 4,
            _real.NVML_GPU_INSTANCE_PROFILE_7_SLICE: 7}
        if gpu.mig is None or profile not in profiles:
            raise _real.NVMLError(_real.NVML_ERROR_NOT_SUPPORTED)
        n, whole = profiles[profile], max(profiles.values())
        info = _real.c_nvmlGpuInstanceProfileInfo_v2_t() if version == 2 else _real.c_nvmlGpuInstanceProfileInfo_t()
        info.id, info.sliceCount = profile, n
        info.multiprocessorCount = gpu.sm_count * n // whole
        mib = gpu.memory_total >> 20
        info.memorySizeMB = mib if n == whole else mib * n // (whole + 1)
        return info

    # ------------------------------------------------------------------------------------ MIG

    def nvmlDeviceGetMigMode(self, handle: _Handle) -> list[int]:
        gpu = self._gpu("nvmlDeviceGetMigMode", handle)
        mode = _real.NVML_DEVICE_MIG_ENABLE if gpu.mig is not None else _real.NVML_DEVICE_MIG_DISABLE
        return [mode, mode]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: _Handle) -> int:
        gpu = self._gpu("nvmlDeviceGetMaxMigDeviceCount", handle)
        return 0 if gpu.mig is None else 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: _Handle, index: int) -> _MigHandle:
        gpu = self._gpu("nvmlDeviceGetMigDeviceHandleByIndex", handle)
        if not gpu.mig or not 0 <= index < len(gpu.mig):
            raise _real.NVMLError(_real.NVML_ERROR_NOT_FOUND)
        return _MigHandle(handle.index, index, self.generation)

    def nvmlDeviceIsMigDeviceHandle(self, handle: Any) -> int:
        return int(isinstance(handle, _MigHandle))

    def nvmlDeviceGetGpuInstanceId(self, handle: Any) -> int:
        if not isinstance(handle, _MigHandle):
            raise _real.NVMLError(_real.NVML_ERROR_NOT_SUPPORTED)
        return self._gpu("nvmlDeviceGetGpuInstanceId", handle).gpu_instance_id

    def nvmlDeviceGetUtilizationRates(self, handle: _Handle) -> Any:
        gpu = self._gpu("nvmlDeviceGetUtilizationRates", handle)
        util = _real.c_nvmlUtilization_t()
        util.gpu, util.memory = gpu.gpu_util, gpu.mem_util
        return util

    def nvmlDeviceGetPowerUsage(self, handle: _Handle) -> int:
        return self._gpu("nvmlDeviceGetPowerUsage", handle).power_mw

    def nvmlDeviceGetTemperature(self, handle: _Handle, sensor: int) -> int:
        gpu = self._gpu("nvmlDeviceGetTemperature", handle)
        if sensor != _real.NVML_TEMPERATURE_GPU:
            raise _real.NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT)
        return gpu.temperature_c

    def nvmlDeviceGetClockInfo(self, handle: _Handle, clock_type: int) -> int:
        gpu = self._gpu("nvmlDeviceGetClockInfo", handle)
        if clock_type != _real.NVML_CLOCK_SM:
            raise _real.NVMLError(_real.NVML_ERROR_NOT_SUPPORTED)
        return gpu.sm_clock_mhz

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: _Handle) -> int:
        return self._gpu("nvmlDeviceGetCurrentClocksEventReasons", handle).throttle_reasons

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: _Handle) -> int:
        return self._gpu("nvmlDeviceGetCurrentClocksThrottleReasons", handle).throttle_reasons

    def nvmlDeviceGetTotalEccErrors(self, handle: _Handle, error_type: int, counter_type: int) -> int:
        return self._gpu("nvmlDeviceGetTotalEccErrors", handle).ecc_uncorrected

    # ------------------------------------------------------------------------------------ processes

    def nvmlDeviceGetComputeRunningProcesses(self, handle: _Handle) -> list[Any]:
        self.calls["nvmlDeviceGetComputeRunningProcesses"] += 1
        if self.process_api < 3:  # nvidia-ml-py 12+: the unversioned name is v3 behind a version check
            raise _real.NVMLLibraryMismatchError("Unversioned function called and the pyNVML version does not "
                                                 "match the NVML lib version")
        return self._processes("nvmlDeviceGetComputeRunningProcesses", handle)

    def nvmlDeviceGetComputeRunningProcesses_v3(self, handle: _Handle) -> list[Any]:
        if self.process_api < 3:
            self.calls["nvmlDeviceGetComputeRunningProcesses_v3"] += 1
            raise _real.NVMLError(_real.NVML_ERROR_FUNCTION_NOT_FOUND)
        return self._processes("nvmlDeviceGetComputeRunningProcesses_v3", handle)

    def nvmlDeviceGetComputeRunningProcesses_v2(self, handle: _Handle) -> list[Any]:
        if self.process_api < 2:
            self.calls["nvmlDeviceGetComputeRunningProcesses_v2"] += 1
            raise _real.NVMLError(_real.NVML_ERROR_FUNCTION_NOT_FOUND)
        return self._processes("nvmlDeviceGetComputeRunningProcesses_v2", handle)

    def _processes(self, fn: str, handle: _Handle) -> list[Any]:
        gpu = self._gpu(fn, handle)
        return [
            SimpleNamespace(pid=p.pid, usedGpuMemory=p.used_memory, gpuInstanceId=0xFFFFFFFF,
                            computeInstanceId=0xFFFFFFFF)
            for p in gpu.processes
        ]

    def nvmlDeviceGetProcessUtilization(self, handle: _Handle, timestamp: int) -> list[Any]:
        gpu = self._gpu("nvmlDeviceGetProcessUtilization", handle)
        gpu.util_reads += 1
        if gpu.util_reads % gpu.util_period_reads == 0:  # a sample period ended since the last read
            gpu.util_timestamp += 1_000_000
        samples = []
        for p in gpu.processes:
            if p.sm_util is None:
                continue
            s = _real.c_nvmlProcessUtilizationSample_t()
            s.pid, s.timeStamp, s.smUtil, s.memUtil = p.pid, gpu.util_timestamp, p.sm_util, 0
            if s.timeStamp > timestamp:
                samples.append(s)
        if not samples:  # what the driver says when no process ran since `timestamp`
            raise _real.NVMLError(_real.NVML_ERROR_NOT_FOUND)
        return samples

    # ------------------------------------------------------------------------------------ GPM

    def nvmlGpmMigSampleGet(self, handle: _Handle, gpu_instance_id: int, sample: Any) -> Any:
        gpu = self._gpu("nvmlGpmMigSampleGet", handle)
        if gpu.gpm is None:
            raise _real.NVMLError(_real.NVML_ERROR_NOT_SUPPORTED)
        k = next((k for k, m in enumerate(gpu.mig or []) if m.gpu_instance_id == gpu_instance_id), None)
        if k is None:
            raise _real.NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT)
        address = ctypes.cast(sample, ctypes.c_void_p).value or 0
        if address not in self._gpm_samples:
            raise _real.NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT)
        self._gpm_samples[address] = ((handle.index, k), self._gpm_samples[address][1])
        return sample

    def nvmlGpmQueryDeviceSupport(self, handle: _Handle) -> Any:
        gpu = self._gpu("nvmlGpmQueryDeviceSupport", handle)
        support = _real.c_nvmlGpmSupport_t()
        support.version = _real.NVML_GPM_SUPPORT_VERSION
        support.isSupportedDevice = 0 if gpu.gpm is None else 1
        return support

    def nvmlGpmSampleAlloc(self) -> Any:
        self.calls["nvmlGpmSampleAlloc"] += 1
        struct = _real.struct_c_nvmlGpmSample_t()
        sample = _real.c_nvmlGpmSample_t(struct)
        self._gpm_samples[ctypes.addressof(struct)] = (-1, struct)
        return sample

    def nvmlGpmSampleFree(self, sample: Any) -> None:
        self.calls["nvmlGpmSampleFree"] += 1
        self._gpm_samples.pop(ctypes.cast(sample, ctypes.c_void_p).value or 0, None)

    def nvmlGpmSampleGet(self, handle: _Handle, sample: Any) -> Any:
        gpu = self._gpu("nvmlGpmSampleGet", handle)
        if gpu.gpm is None:
            raise _real.NVMLError(_real.NVML_ERROR_NOT_SUPPORTED)
        address = ctypes.cast(sample, ctypes.c_void_p).value or 0
        if address not in self._gpm_samples:
            raise _real.NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT)
        self._gpm_samples[address] = (handle.index, self._gpm_samples[address][1])
        return sample

    def nvmlGpmMetricsGet(self, metrics_get: Any) -> Any:
        self.calls["nvmlGpmMetricsGet"] += 1
        if metrics_get.version != _real.NVML_GPM_METRICS_GET_VERSION:
            raise _real.NVMLError(_real.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        first = self._gpm_samples.get(ctypes.cast(metrics_get.sample1, ctypes.c_void_p).value or 0)
        second = self._gpm_samples.get(ctypes.cast(metrics_get.sample2, ctypes.c_void_p).value or 0)
        if first is None or second is None or first[0] == -1 or first[0] != second[0]:
            raise _real.NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT)
        key = first[0]
        gpu = self.gpus[key[0]].mig[key[1]] if isinstance(key, tuple) else self.gpus[key]  # type: ignore[index]
        if isinstance(key, tuple) and self.gpus[key[0]].lost:
            raise _real.NVMLError(_real.NVML_ERROR_GPU_IS_LOST)
        if gpu.lost:
            raise _real.NVMLError(_real.NVML_ERROR_GPU_IS_LOST)
        for k in range(metrics_get.numMetrics):
            metric = metrics_get.metrics[k]
            value = (gpu.gpm or {}).get(metric.metricId)
            if value is None:
                metric.nvmlReturn = _real.NVML_ERROR_NOT_SUPPORTED
            else:
                metric.nvmlReturn, metric.value = _real.NVML_SUCCESS, float(value)
        return metrics_get

    # ------------------------------------------------------------------------------------ events (XID)

    def nvmlEventSetCreate(self) -> Any:
        self.calls["nvmlEventSetCreate"] += 1
        return SimpleNamespace(kind="fake-event-set")

    def nvmlEventSetFree(self, event_set: Any) -> None:
        self.calls["nvmlEventSetFree"] += 1

    def nvmlDeviceRegisterEvents(self, handle: _Handle, event_types: int, event_set: Any) -> None:
        self._gpu("nvmlDeviceRegisterEvents", handle)
        if event_types & _real.nvmlEventTypeXidCriticalError:
            self._registered.add(handle.index)

    def nvmlEventSetWait_v2(self, event_set: Any, timeout_ms: int) -> Any:
        self.calls["nvmlEventSetWait_v2"] += 1
        for index in sorted(self._registered):
            gpu = self.gpus[index]
            if gpu.xid_events:
                xid = gpu.xid_events.pop(0)
                return SimpleNamespace(device=self._handles[index], eventType=_real.nvmlEventTypeXidCriticalError,
                                       eventData=xid, gpuInstanceId=0, computeInstanceId=0)
        raise _real.NVMLError(_real.NVML_ERROR_TIMEOUT)

    def nvmlEventSetWait(self, event_set: Any, timeout_ms: int) -> Any:
        return self.nvmlEventSetWait_v2(event_set, timeout_ms)


def fleet(n_gpus: int = 8, procs_per_gpu: int = 32, *, gpm: bool = True) -> FakeNVML:
    """A busy host: n GPUs with procs_per_gpu processes each (pids 10000+), GPM on (the benchmark's setup)."""
    gpus = []
    for g in range(n_gpus):
        procs = [FakeProcess(pid=10_000 + g * procs_per_gpu + k, used_memory=(k + 1) * 64 * (1 << 20),
                             sm_util=(g * 7 + k) % 100) for k in range(procs_per_gpu)]
        gpus.append(FakeGPU(memory_used=sum(p.used_memory or 0 for p in procs), gpu_util=50 + g, mem_util=20,
                            processes=procs,
                            gpm={_real.NVML_GPM_METRIC_SM_UTIL: 45.0, _real.NVML_GPM_METRIC_SM_OCCUPANCY: 30.0,
                                 _real.NVML_GPM_METRIC_ANY_TENSOR_UTIL: 12.5} if gpm else None))
    return FakeNVML(gpus)
