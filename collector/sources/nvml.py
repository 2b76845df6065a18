"""The `nvml` device source: NVIDIA GPUs read through nvidia-ml-py (`pynvml`), every metric optional.

Modelled on nvitop's `api/device.py`: each NVML call that fails for one metric (not supported, no permission,
an old driver without the function) gives None for that metric and the sample goes on; a metric that says
"not supported" once is not asked again. A GPU that fell off the bus (NVMLError_GpuIsLost) gives a reading
with `lost=True`; the other GPUs are sampled as usual.

Per device: utilisation, memory utilisation, memory used/total, power, temperature, SM clock, clock-event
(throttle) reasons, uncorrected volatile ECC errors, and XID critical errors counted from an NVML event set
since the source opened. With GPM (Hopper and later): SM active, SM occupancy and tensor-pipe activity over
the interval between two samples. Per process: used memory and SM utilisation. All fractions are 0..1.

Tests replace the module attribute `pynvml` (or pass `nvml=`) with tests/fakes/fake_pynvml.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import pynvml

from collector.sources.base import DeviceInfo, DeviceReading, ProcessReading, SourceUnavailable

log = logging.getLogger(__name__)

# errors that say the metric will never be readable on this device: stop asking
_PERMANENT = ("NVMLError_NotSupported", "NVMLError_FunctionNotFound")


class _Lost(Exception):
    """The GPU fell off the bus while we read it."""


def _fraction(percent: float | None) -> float | None:
    if percent is None:
        return None
    return min(max(float(percent) / 100.0, 0.0), 1.0)


class NvmlSource:
    """A DeviceSource over every GPU NVML reports; raises SourceUnavailable when NVML cannot start."""

    name = "nvml"

    def __init__(self, *, nvml: Any = None, gpm: bool = True, clock: Callable[[], float] = time.time) -> None:
        self.nvml = nvml if nvml is not None else pynvml
        self._clock = clock
        nv = self.nvml
        try:
            nv.nvmlInit()
        except nv.NVMLError as exc:
            raise SourceUnavailable(
                f"NVML cannot start ({exc}): no NVIDIA driver here; use FLEETLENS_SOURCE=cpu or replay"
            ) from exc
        self._open = True
        try:
            count = nv.nvmlDeviceGetCount()
            self._handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        except nv.NVMLError as exc:
            self.close()
            raise SourceUnavailable(f"NVML started but cannot list GPUs ({exc})") from exc
        self._unsupported: list[set[str]] = [set() for _ in self._handles]
        self._infos = [self._info(i, h) for i, h in enumerate(self._handles)]
        self._proc_ts = [0 for _ in self._handles]  # last process-utilisation timestamp seen (µs)
        self._gpm: list[list[Any] | None] = [self._gpm_open(h) if gpm else None for h in self._handles]
        self._xid_counts: list[int | None] = [None for _ in self._handles]
        self._events = self._events_open()

    # ------------------------------------------------------------------------------------------- setup

    def _info(self, index: int, handle: Any) -> DeviceInfo:
        nv = self.nvml

        def text(value: Any) -> str:
            return value.decode() if isinstance(value, bytes) else str(value)

        try:
            uuid = text(nv.nvmlDeviceGetUUID(handle))
        except nv.NVMLError:
            uuid = f"nvml-index-{index}"  # a lost GPU at start still gets a row, marked lost by its first sample
        try:
            name = text(nv.nvmlDeviceGetName(handle))
        except nv.NVMLError:
            name = "NVIDIA GPU"
        try:
            total = int(nv.nvmlDeviceGetMemoryInfo(handle).total)
        except nv.NVMLError:
            total = None
        return DeviceInfo(index=index, uuid=uuid, name=name, memory_total=total)

    def _gpm_open(self, handle: Any) -> list[Any] | None:
        """[previous sample, current sample, previous taken?(, request)] when the GPU supports GPM, else None."""
        nv = self.nvml
        try:
            if not nv.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice:
                return None
            return [nv.nvmlGpmSampleAlloc(), nv.nvmlGpmSampleAlloc(), False]
        except (nv.NVMLError, AttributeError):
            return None

    def _events_open(self) -> Any:
        nv = self.nvml
        try:
            events = nv.nvmlEventSetCreate()
        except (nv.NVMLError, AttributeError):
            return None
        for i, handle in enumerate(self._handles):
            try:
                nv.nvmlDeviceRegisterEvents(handle, nv.nvmlEventTypeXidCriticalError, events)
                self._xid_counts[i] = 0
            except nv.NVMLError:
                pass  # XIDs stay unknown (None) on this GPU
        return events

    # ------------------------------------------------------------------------------------------- reading

    def _call(self, i: int, fn_name: str, *args: Any) -> Any:
        """One NVML call for device i; None when that metric is unavailable, _Lost when the GPU is gone."""
        if fn_name in self._unsupported[i]:
            return None
        nv = self.nvml
        fn = getattr(nv, fn_name, None)
        if fn is None:
            self._unsupported[i].add(fn_name)
            return None
        try:
            return fn(self._handles[i], *args)
        except nv.NVMLError_GpuIsLost:
            raise _Lost from None
        except nv.NVMLError as exc:
            if type(exc).__name__ in _PERMANENT:
                self._unsupported[i].add(fn_name)
            return None

    def devices(self) -> list[DeviceInfo]:
        return list(self._infos)

    def sample(self) -> list[DeviceReading]:
        self._drain_xid_events()
        readings = []
        for i in range(len(self._handles)):
            reading = DeviceReading(index=i, ts=self._clock())
            try:
                self._read_device(i, reading)
            except _Lost:
                reading.lost = True
                reading.processes = []
            readings.append(reading)
        return readings

    def _read_device(self, i: int, r: DeviceReading) -> None:
        nv = self.nvml
        util = self._call(i, "nvmlDeviceGetUtilizationRates")
        if util is not None:
            r.gpu_util, r.mem_util = _fraction(util.gpu), _fraction(util.memory)
        mem = self._call(i, "nvmlDeviceGetMemoryInfo")
        if mem is not None:
            r.mem_used, r.mem_total = int(mem.used), int(mem.total)
        else:
            r.mem_total = self._infos[i].memory_total
        power = self._call(i, "nvmlDeviceGetPowerUsage")
        r.power_w = None if power is None else power / 1000.0
        temp = self._call(i, "nvmlDeviceGetTemperature", nv.NVML_TEMPERATURE_GPU)
        r.temperature_c = None if temp is None else float(temp)
        clock = self._call(i, "nvmlDeviceGetClockInfo", nv.NVML_CLOCK_SM)
        r.sm_clock_mhz = None if clock is None else float(clock)
        reasons = self._call(i, "nvmlDeviceGetCurrentClocksEventReasons")
        if reasons is None:  # drivers before 535 only know the old name
            reasons = self._call(i, "nvmlDeviceGetCurrentClocksThrottleReasons")
        r.throttle_reasons = None if reasons is None else int(reasons)
        ecc = self._call(i, "nvmlDeviceGetTotalEccErrors", nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                         nv.NVML_VOLATILE_ECC)
        r.ecc_errors = None if ecc is None else int(ecc)
        r.xid_errors = self._xid_counts[i]
        self._read_gpm(i, r)
        r.processes = self._read_processes(i)

    def _read_gpm(self, i: int, r: DeviceReading) -> None:
        state = self._gpm[i]
        if state is None:
            return
        nv = self.nvml
        prev, cur, have_prev = state[:3]
        try:
            nv.nvmlGpmSampleGet(self._handles[i], cur)
        except nv.NVMLError_GpuIsLost:
            raise _Lost from None
        except nv.NVMLError as exc:
            if type(exc).__name__ in _PERMANENT:
                self._gpm[i] = None
            return
        state[0], state[1], state[2] = cur, prev, True
        if not have_prev:
            return  # GPM metrics are rates between two samples: the first sample only starts the clock
        wanted = (nv.NVML_GPM_METRIC_SM_UTIL, nv.NVML_GPM_METRIC_SM_OCCUPANCY, nv.NVML_GPM_METRIC_ANY_TENSOR_UTIL)
        if len(state) < 4:  # one request structure per GPU, reused: it holds room for every GPM metric
            state.append(nv.c_nvmlGpmMetricsGet_t())
        md = state[3]
        md.version = nv.NVML_GPM_METRICS_GET_VERSION
        md.numMetrics = len(wanted)
        md.sample1, md.sample2 = prev, cur
        for k, metric in enumerate(wanted):
            md.metrics[k].metricId = metric
            md.metrics[k].nvmlReturn = nv.NVML_ERROR_UNKNOWN  # never read a value NVML did not write
        try:
            nv.nvmlGpmMetricsGet(md)
        except nv.NVMLError_GpuIsLost:
            raise _Lost from None
        except nv.NVMLError:
            return
        values = [
            _fraction(md.metrics[k].value) if md.metrics[k].nvmlReturn == nv.NVML_SUCCESS else None
            for k in range(len(wanted))
        ]
        r.sm_active, r.sm_occupancy, r.tensor_active = values

    def _read_processes(self, i: int) -> list[ProcessReading]:
        procs: dict[int, ProcessReading] = {}
        running = self._call(i, "nvmlDeviceGetComputeRunningProcesses")
        for p in running or ():
            pid, used = int(p.pid), getattr(p, "usedGpuMemory", None)
            procs[pid] = ProcessReading(pid=pid, mem_used=None if used is None else int(used))
        nv = self.nvml
        if "nvmlDeviceGetProcessUtilization" in self._unsupported[i]:
            return list(procs.values())
        try:
            samples = nv.nvmlDeviceGetProcessUtilization(self._handles[i], self._proc_ts[i])
        except nv.NVMLError_GpuIsLost:
            raise _Lost from None
        except nv.NVMLError_NotFound:
            samples = []  # no process ran a kernel since the last call: a normal answer
        except nv.NVMLError as exc:
            if type(exc).__name__ in _PERMANENT:
                self._unsupported[i].add("nvmlDeviceGetProcessUtilization")
            return list(procs.values())  # SM utilisation unknown this time: missing, not 0
        # each field read once: pynvml structures make every attribute access a Python call
        latest: dict[int, tuple[int, int]] = {}
        newest = self._proc_ts[i]
        for s in samples:
            pid, stamp, sm = s.pid, s.timeStamp, s.smUtil
            if stamp > newest:
                newest = stamp
            seen = latest.get(pid)
            if seen is None or stamp > seen[0]:
                latest[pid] = (stamp, sm)
        self._proc_ts[i] = newest
        for reading in procs.values():
            seen = latest.get(reading.pid)
            # NVML answered for the interval: a process without a sample in it ran no kernel
            reading.sm_util = 0.0 if seen is None else _fraction(seen[1])
        return list(procs.values())

    def _drain_xid_events(self) -> None:
        if self._events is None:
            return
        nv = self.nvml
        for _ in range(1024):  # bounded: a flapping GPU must not stall the sample
            try:
                data = nv.nvmlEventSetWait_v2(self._events, 0)
            except nv.NVMLError:  # Timeout: nothing pending (or the set broke: try again next sample)
                return
            try:
                index = int(nv.nvmlDeviceGetIndex(data.device))
            except nv.NVMLError:
                continue
            if 0 <= index < len(self._xid_counts) and self._xid_counts[index] is not None:
                self._xid_counts[index] += 1
                log.warning("GPU %d reported XID %d", index, int(data.eventData))

    def close(self) -> None:
        if not getattr(self, "_open", False):
            return
        nv = self.nvml
        for state in getattr(self, "_gpm", []) or []:
            for sample in (state or [])[:2]:
                try:
                    nv.nvmlGpmSampleFree(sample)
                except nv.NVMLError:
                    pass
        if getattr(self, "_events", None) is not None:
            try:
                nv.nvmlEventSetFree(self._events)
            except nv.NVMLError:
                pass
        try:
            nv.nvmlShutdown()
        except nv.NVMLError:
            pass
        self._open = False


__all__ = ["NvmlSource"]
