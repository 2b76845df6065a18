"""The `nvml` device source: NVIDIA GPUs read through nvidia-ml-py (`pynvml`), every metric optional.

Modelled on nvitop's `api/device.py`: each NVML call that fails for one metric (not supported, no permission,
an old driver without the function) gives None for that metric and the sample goes on; a metric that says
"not supported" once is not asked again (until the devices change, see MIG below). A GPU that fell off the bus
(NVMLError_GpuIsLost) gives a reading with `lost=True`; the other GPUs are sampled as usual. A GPU whose handle
cannot even be had at start-up is listed all the same (as `nvml-index-<i>`), its readings `lost`, and said in
the log: one bad GPU never turns the whole host into a `cpu` host.

Per device: utilisation, memory utilisation, memory used/total, power, temperature, SM clock, clock-event
(throttle) reasons, uncorrected volatile ECC errors, and XID critical errors counted from an NVML event set
since the source opened. With GPM (Hopper and later): SM active, SM occupancy and tensor-pipe activity over
the interval between two samples. Per process: used memory and SM utilisation. All fractions are 0..1.

Versions. Memory is read with `nvmlDeviceGetMemoryInfo_v2` where the driver has it: v1's `used` counts the
memory the driver reserves for itself (about 0.9 GB on an idle A100 against a few MB by v2), which would make
every empty GPU look held. A driver without v2 gets v1; `memory_api` says which each device used. Running
processes are read with the newest of `nvmlDeviceGetComputeRunningProcesses_v3` / `_v2` the driver has: with
nvidia-ml-py 12+ the unversioned call needs v3 and raises NVMLLibraryMismatchError (not an NVMLError) on an
older driver, so that error, like FunctionNotFound, only moves the source down to the next version.

MIG. A GPU in MIG mode is not one device: each of its MIG devices (compute instances) is listed as a device of
its own, with its `MIG-` UUID, its memory, its parent's UUID and its `slice_weight` (its share of the parent's
SMs; of its memory where the SM count is unreadable), and the parent is not listed. Device utilisation is not
supported on MIG, so a MIG device's `gpu_util` is GPM's graphics-engine activity for its GPU instance (the
DCGM_FI_PROF_GR_ENGINE_ACTIVE equivalent) where GPM runs. A MIG device's index on the host is
`MIG_INDEX_BASE * (parent index + 1) + its MIG index`, so it never collides with a whole GPU's. MIG handles go
stale when instances are created or destroyed (and after a reset): the source enumerates again every
`refresh_s` and at once after an invalid-handle answer, and starts afresh (handles, GPM samples, what was
"not supported") whenever the list changed.

Tests replace the module attribute `pynvml` (or pass `nvml=`) with tests/fakes/fake_pynvml.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import pynvml

from collector.sources.base import DeviceInfo, DeviceReading, ProcessReading, SourceUnavailable
from collector.sources.mig_weight import slice_weight, whole_gpu_profile
from collector.sources.nvml_device import (
    MIG_INDEX_BASE,
    PERMANENT,
    PROCESS_CALLS,
    STALE,
    Lost,
    NvmlDevice,
    as_fraction,
    as_text,
)

log = logging.getLogger(__name__)


class GpusUnreadable(SourceUnavailable):
    """NVML started (the driver is there) but could not list the GPUs: said as a warning, not a quiet fallback."""


class NvmlSource:
    """A DeviceSource over every GPU (and MIG device) NVML reports; raises SourceUnavailable when NVML cannot
    start."""

    name = "nvml"

    def __init__(self, *, nvml: Any = None, gpm: bool = True, clock: Callable[[], float] = time.time,
                 refresh_s: float = 30.0) -> None:
        self.nvml = nvml if nvml is not None else pynvml
        self._clock = clock
        self._use_gpm = gpm
        self.refresh_s = refresh_s
        self.refreshes = 0  # how often the device list changed since the source opened
        nv = self.nvml
        try:
            nv.nvmlInit()
        except nv.NVMLError as exc:
            raise SourceUnavailable(
                f"NVML cannot start ({exc}): no NVIDIA driver here; use FLEETLENS_SOURCE=cpu or replay"
            ) from exc
        self._open = True
        self._events: Any = None
        self._devs: list[NvmlDevice] = []
        self._whole_profiles: dict[int, Any] = {}  # physical GPU index -> its largest GPU-instance profile
        try:
            self._devs = self._enumerate(warn=True)
        except nv.NVMLError as exc:
            self.close()
            raise GpusUnreadable(f"NVML started but cannot list GPUs ({exc})") from exc
        self._setup()
        self._stale = False
        self._next_refresh = time.monotonic() + refresh_s

    # ------------------------------------------------------------------------------------------- setup

    def _enumerate(self, *, warn: bool) -> list[NvmlDevice]:
        """The devices as NVML has them now (raises NVMLError only when it cannot count the GPUs)."""
        nv = self.nvml
        devs: list[NvmlDevice] = []
        for i in range(nv.nvmlDeviceGetCount()):
            try:
                handle = nv.nvmlDeviceGetHandleByIndex(i)
            except nv.NVMLError as exc:
                if warn:
                    log.warning("NVML cannot open GPU %d (%s): listed as lost; the other GPUs are sampled", i, exc)
                devs.append(NvmlDevice(index=i, handle=None, physical=i))
                continue
            migs = self._mig_devices(i, handle)
            devs.extend(migs or [NvmlDevice(index=i, handle=handle, physical=i)])
        return devs

    def _mig_devices(self, i: int, handle: Any) -> list[NvmlDevice]:
        nv = self.nvml
        try:
            if int(nv.nvmlDeviceGetMigMode(handle)[0]) != nv.NVML_DEVICE_MIG_ENABLE:
                return []
            count = int(nv.nvmlDeviceGetMaxMigDeviceCount(handle))
        except (nv.NVMLError, AttributeError):
            return []  # no MIG on this GPU (or a driver without the calls)
        found = []
        for k in range(count):
            try:
                mig = nv.nvmlDeviceGetMigDeviceHandleByIndex(handle, k)
            except nv.NVMLError:
                continue  # no compute instance at this MIG index
            try:
                gi = int(nv.nvmlDeviceGetGpuInstanceId(mig))
            except nv.NVMLError:
                gi = None
            found.append(NvmlDevice(index=MIG_INDEX_BASE * (i + 1) + k, handle=mig, physical=i, parent=handle,
                              gpu_instance=gi))
        return found

    def _setup(self) -> None:
        for dev in self._devs:
            dev.info = self._info(dev)
            dev.gpm = self._gpm_open(dev) if self._use_gpm and dev.handle is not None else None
        self._events = self._events_open()

    def _info(self, dev: NvmlDevice) -> DeviceInfo:
        nv = self.nvml
        uuid, name, total = f"nvml-index-{dev.index}", "NVIDIA GPU", None
        if dev.handle is None:
            return DeviceInfo(index=dev.index, uuid=uuid, name=name, memory_total=None)
        try:
            uuid = as_text(nv.nvmlDeviceGetUUID(dev.handle))
        except nv.NVMLError:
            pass  # a lost GPU at start still gets a row, marked lost by its first sample
        try:
            name = as_text(nv.nvmlDeviceGetName(dev.handle))
        except nv.NVMLError:
            pass
        try:
            mem = self._memory(dev)
        except Lost:
            mem = None
        total = None if mem is None else int(mem.total)
        parent_uuid = weight = None
        if dev.parent is not None:
            try:
                parent_uuid = as_text(nv.nvmlDeviceGetUUID(dev.parent))
            except nv.NVMLError:
                pass
            weight = self._slice_weight(dev, total)
        return DeviceInfo(index=dev.index, uuid=uuid, name=name, memory_total=total, parent_uuid=parent_uuid,
                          slice_weight=weight)

    def _slice_weight(self, dev: NvmlDevice, total: int | None) -> float | None:
        """A MIG device's share of its parent (collector.sources.mig_weight); the parent's profile asked once."""
        if dev.physical not in self._whole_profiles:
            self._whole_profiles[dev.physical] = whole_gpu_profile(self.nvml, dev.parent)
        return slice_weight(self.nvml, dev.handle, dev.parent, total, self._whole_profiles[dev.physical])

    def _gpm_open(self, dev: NvmlDevice) -> list[Any] | None:
        """[previous sample, current sample, previous taken?(, request)] when the GPU supports GPM, else None."""
        nv = self.nvml
        try:
            if not nv.nvmlGpmQueryDeviceSupport(dev.parent if dev.parent is not None else dev.handle
                                                ).isSupportedDevice:
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
        registered: set[int] = set()
        for dev in self._devs:
            target = dev.parent if dev.parent is not None else dev.handle
            if target is None:
                continue
            if dev.physical not in registered:
                try:
                    nv.nvmlDeviceRegisterEvents(target, nv.nvmlEventTypeXidCriticalError, events)
                    registered.add(dev.physical)
                except nv.NVMLError:
                    continue  # XIDs stay unknown (None) on this GPU
            dev.xids = 0
        return events

    def _teardown(self) -> None:
        """Free what the devices hold in NVML (GPM samples, the event set)."""
        nv = self.nvml
        for dev in self._devs:
            for sample in (dev.gpm or [])[:2]:
                try:
                    nv.nvmlGpmSampleFree(sample)
                except nv.NVMLError:
                    pass
            dev.gpm = None
        if self._events is not None:
            try:
                nv.nvmlEventSetFree(self._events)
            except nv.NVMLError:
                pass
            self._events = None

    def refresh(self) -> bool:
        """Enumerate the devices again; when the list changed (MIG instances made or destroyed, a GPU back after
        a reset), start afresh with the new one. True when it changed."""
        self._stale = False
        self._next_refresh = time.monotonic() + self.refresh_s
        try:
            devs = self._enumerate(warn=False)
        except self.nvml.NVMLError as exc:
            log.warning("NVML could not list the GPUs again (%s); keeping the devices it had", exc)
            return False
        before = [(d.index, d.physical, d.gpu_instance, d.handle is None) for d in self._devs]
        if [(d.index, d.physical, d.gpu_instance, d.handle is None) for d in devs] == before:
            if devs:  # same devices: new handles all the same (NVML may reuse a MIG handle for another instance)
                for old, new in zip(self._devs, devs, strict=True):
                    old.handle, old.parent = new.handle, new.parent
            return False
        self._teardown()
        self._devs = devs
        self._setup()
        self.refreshes += 1
        log.info("NVML devices changed (MIG reconfigured or a GPU reset): now %s",
                 ", ".join(f"{d.index}={d.info.uuid if d.info else '?'}" for d in self._devs))
        return True

    # ------------------------------------------------------------------------------------------- reading

    def _call(self, dev: NvmlDevice, fn_name: str, *args: Any) -> Any:
        """One NVML call for a device; None when that metric is unavailable, Lost when the GPU is gone."""
        if fn_name in dev.unsupported:
            return None
        nv = self.nvml
        fn = getattr(nv, fn_name, None)
        if fn is None:
            dev.unsupported.add(fn_name)
            return None
        try:
            return fn(dev.handle, *args)
        except nv.NVMLError_GpuIsLost:
            raise Lost from None
        except nv.NVMLLibraryMismatchError:
            dev.unsupported.add(fn_name)  # the binding wants a newer driver for this name: never again
            return None
        except nv.NVMLError as exc:
            kind = type(exc).__name__
            if kind in PERMANENT:
                dev.unsupported.add(fn_name)
            elif kind in STALE:
                self._stale = True
            return None

    def _memory(self, dev: NvmlDevice) -> Any:
        """Memory info, v2 where the driver has it (and says which was used), else v1."""
        nv = self.nvml
        if dev.memory_api != "v1":
            try:
                mem = nv.nvmlDeviceGetMemoryInfo(dev.handle, version=nv.nvmlMemory_v2)
            except nv.NVMLError_GpuIsLost:
                raise Lost from None
            except (nv.NVMLError, nv.NVMLLibraryMismatchError, AttributeError, TypeError) as exc:
                if type(exc).__name__ not in (*PERMANENT, "NVMLLibraryMismatchError", "AttributeError", "TypeError"):
                    return None  # a passing failure: no figure this time, v2 tried again next time
                dev.memory_api = "v1"
                log.info("GPU %d: this driver has no nvmlDeviceGetMemoryInfo_v2 (%s); memory used is read with v1, "
                         "which counts the driver's reserved memory as used", dev.index, exc)
            else:
                if dev.memory_api is None:
                    dev.memory_api = "v2"
                return mem
        return self._call(dev, "nvmlDeviceGetMemoryInfo")

    @property
    def memory_api(self) -> dict[int, str | None]:
        """{device index: "v2" | "v1" | None (not read yet)}: which memory call each device's figures come from."""
        return {d.index: d.memory_api for d in self._devs}

    def devices(self) -> list[DeviceInfo]:
        return [d.info for d in self._devs if d.info is not None]

    def sample(self) -> list[DeviceReading]:
        if self._stale or time.monotonic() >= self._next_refresh:
            self.refresh()
        self._drain_xid_events()
        readings = []
        for dev in self._devs:
            reading = DeviceReading(index=dev.index, ts=self._clock())
            try:
                if dev.handle is None:
                    raise Lost
                self._read_device(dev, reading)
            except Lost:
                reading.lost = True
                reading.processes = []
            readings.append(reading)
        return readings

    def _read_device(self, dev: NvmlDevice, r: DeviceReading) -> None:
        nv = self.nvml
        util = None if dev.parent is not None else self._call(dev, "nvmlDeviceGetUtilizationRates")
        if util is not None:
            r.gpu_util, r.mem_util = as_fraction(util.gpu), as_fraction(util.memory)
        mem = self._memory(dev)
        if mem is not None:
            r.mem_used, r.mem_total = int(mem.used), int(mem.total)
        else:
            r.mem_total = dev.info.memory_total if dev.info else None
        power = self._call(dev, "nvmlDeviceGetPowerUsage")
        r.power_w = None if power is None else power / 1000.0
        temp = self._call(dev, "nvmlDeviceGetTemperature", nv.NVML_TEMPERATURE_GPU)
        r.temperature_c = None if temp is None else float(temp)
        clock = self._call(dev, "nvmlDeviceGetClockInfo", nv.NVML_CLOCK_SM)
        r.sm_clock_mhz = None if clock is None else float(clock)
        reasons = self._call(dev, "nvmlDeviceGetCurrentClocksEventReasons")
        if reasons is None:  # drivers before 535 only know the old name
            reasons = self._call(dev, "nvmlDeviceGetCurrentClocksThrottleReasons")
        r.throttle_reasons = None if reasons is None else int(reasons)
        ecc = self._call(dev, "nvmlDeviceGetTotalEccErrors", nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                         nv.NVML_VOLATILE_ECC)
        r.ecc_errors = None if ecc is None else int(ecc)
        r.xid_errors = dev.xids
        self._read_gpm(dev, r)
        r.processes = self._read_processes(dev, r.gpu_util)

    def _read_gpm(self, dev: NvmlDevice, r: DeviceReading) -> None:
        state = dev.gpm
        if state is None:
            return
        nv = self.nvml
        prev, cur, have_prev = state[:3]
        try:
            if dev.parent is not None:  # a MIG device: GPM reads its GPU instance through the parent
                nv.nvmlGpmMigSampleGet(dev.parent, dev.gpu_instance, cur)
            else:
                nv.nvmlGpmSampleGet(dev.handle, cur)
        except nv.NVMLError_GpuIsLost:
            raise Lost from None
        except nv.NVMLError as exc:
            if type(exc).__name__ in PERMANENT:
                dev.gpm = None
            return
        state[0], state[1], state[2] = cur, prev, True
        if not have_prev:
            return  # GPM metrics are rates between two samples: the first sample only starts the clock
        wanted = (nv.NVML_GPM_METRIC_SM_UTIL, nv.NVML_GPM_METRIC_SM_OCCUPANCY, nv.NVML_GPM_METRIC_ANY_TENSOR_UTIL,
                  nv.NVML_GPM_METRIC_GRAPHICS_UTIL)
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
            raise Lost from None
        except nv.NVMLError:
            return
        values = [
            as_fraction(md.metrics[k].value) if md.metrics[k].nvmlReturn == nv.NVML_SUCCESS else None
            for k in range(len(wanted))
        ]
        r.sm_active, r.sm_occupancy, r.tensor_active = values[:3]
        if dev.parent is not None and r.gpu_util is None:
            r.gpu_util = values[3]  # graphics-engine activity of the GPU instance: MIG's utilisation

    def _running(self, dev: NvmlDevice) -> list[Any] | None:
        """The running compute processes through the newest call this driver answers (None: unavailable)."""
        calls = (dev.process_call,) if dev.process_call else PROCESS_CALLS
        for name in calls:
            if name in dev.unsupported:
                continue
            running = self._call(dev, name)
            if running is not None:
                dev.process_call = name
                return running
            if name not in dev.unsupported:
                return None  # a passing failure of a call that exists: no list this time
        return None

    def _read_processes(self, dev: NvmlDevice, gpu_util: float | None) -> list[ProcessReading]:
        """The device's running processes with their memory and SM utilisation. NVML returns one utilisation sample
        per process that ran kernels in its newest sample period (1/6 s to 1 s, by product) newer than the
        timestamp asked for, and NOT_FOUND when it has none: either no process ran a kernel, or no sample period
        ended since the last read (a poll as frequent as the driver's sampling). The device's own utilisation
        (`gpu_util`, read just before) tells the two apart: idle, each process is at 0; busy or unknown, each
        process's share is unknown this time (None, not 0), and readers fall back to the device's utilisation."""
        procs: dict[int, ProcessReading] = {}
        for p in self._running(dev) or ():
            pid, used = int(p.pid), getattr(p, "usedGpuMemory", None)
            procs[pid] = ProcessReading(pid=pid, mem_used=None if used is None else int(used))
        nv = self.nvml
        if "nvmlDeviceGetProcessUtilization" in dev.unsupported:
            return list(procs.values())
        try:
            samples = nv.nvmlDeviceGetProcessUtilization(dev.handle, dev.proc_ts)
        except nv.NVMLError_GpuIsLost:
            raise Lost from None
        except nv.NVMLError_NotFound:
            samples = []  # no sample newer than the last read: no kernel ran, or no sample period ended yet
        except nv.NVMLError as exc:
            if type(exc).__name__ in PERMANENT:
                dev.unsupported.add("nvmlDeviceGetProcessUtilization")
            return list(procs.values())  # SM utilisation unknown this time: missing, not 0
        if not samples:
            if gpu_util == 0.0:  # the device ran no kernel: neither did its processes
                for reading in procs.values():
                    reading.sm_util = 0.0
            return list(procs.values())
        # each field read once: pynvml structures make every attribute access a Python call
        latest: dict[int, tuple[int, int]] = {}
        newest = dev.proc_ts
        for s in samples:
            pid, stamp, sm = s.pid, s.timeStamp, s.smUtil
            if stamp > newest:
                newest = stamp
            seen = latest.get(pid)
            if seen is None or stamp > seen[0]:
                latest[pid] = (stamp, sm)
        dev.proc_ts = newest
        for reading in procs.values():
            seen = latest.get(reading.pid)
            # NVML answered for a new sample period: a process without a sample in it ran no kernel
            reading.sm_util = 0.0 if seen is None else as_fraction(seen[1])
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
            gi = getattr(data, "gpuInstanceId", None)
            for dev in self._devs:
                # a MIG device counts the XIDs of its own GPU instance, and those NVML gives no instance for
                mine = dev.gpu_instance is None or gi in (None, 0xFFFFFFFF) or gi == dev.gpu_instance
                if dev.physical == index and dev.xids is not None and mine:
                    dev.xids += 1
            log.warning("GPU %d reported XID %d", index, int(data.eventData))

    def close(self) -> None:
        if not getattr(self, "_open", False):
            return
        self._teardown()
        try:
            self.nvml.nvmlShutdown()
        except self.nvml.NVMLError:
            pass
        self._open = False


__all__ = ["MIG_INDEX_BASE", "GpusUnreadable", "NvmlSource"]
