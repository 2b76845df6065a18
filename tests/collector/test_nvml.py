"""The nvml source against the fake NVML at the pynvml boundary: metrics, missing metrics, lost GPUs, processes."""

from __future__ import annotations

import pynvml
import pytest

import collector.sources.nvml as nvml_mod
from collector.sources.base import SourceUnavailable
from collector.sources.nvml import NvmlSource
from tests.fakes.fake_pynvml import FakeGPU, FakeNVML, FakeProcess, GiB, fleet
from tests.gpu.probe import nvml_init_error

GPM_FULL = {
    pynvml.NVML_GPM_METRIC_SM_UTIL: 62.0,
    pynvml.NVML_GPM_METRIC_SM_OCCUPANCY: 25.0,
    pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL: 40.0,
}


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeNVML:
    fake = FakeNVML(
        [
            FakeGPU(name="NVIDIA H100 80GB HBM3", memory_used=20 * GiB, gpu_util=87, mem_util=33, power_mw=312_500,
                    temperature_c=61, sm_clock_mhz=1980, throttle_reasons=pynvml.nvmlClocksEventReasonSwPowerCap,
                    ecc_uncorrected=2, gpm=dict(GPM_FULL),
                    processes=[FakeProcess(pid=4242, used_memory=12 * GiB, sm_util=80),
                               FakeProcess(pid=4343, used_memory=None, sm_util=None)]),
            FakeGPU(unsupported={"nvmlDeviceGetPowerUsage", "nvmlDeviceGetTotalEccErrors",
                                 "nvmlDeviceGetProcessUtilization"},
                    denied={"nvmlDeviceGetTemperature"},
                    processes=[FakeProcess(pid=5000, used_memory=GiB, sm_util=10)]),
        ]
    )
    monkeypatch.setattr(nvml_mod, "pynvml", fake)
    return fake


def test_devices_and_every_metric_in_fractions_and_units(fake: FakeNVML) -> None:
    src = NvmlSource()
    infos = src.devices()
    assert [(d.index, d.uuid, d.name, d.memory_total) for d in infos] == [
        (0, "GPU-fake-0000", "NVIDIA H100 80GB HBM3", 80 * GiB), (1, "GPU-fake-0001", "NVIDIA A100-SXM4-80GB", 80 * GiB)
    ]
    src.sample()  # GPM figures are rates between two samples
    r = src.sample()[0]
    assert (r.gpu_util, r.mem_util) == (0.87, 0.33)
    assert (r.mem_used, r.mem_total) == (20 * GiB, 80 * GiB)
    assert r.power_w == 312.5 and r.temperature_c == 61 and r.sm_clock_mhz == 1980
    assert r.throttle_reasons == pynvml.nvmlClocksEventReasonSwPowerCap and r.ecc_errors == 2
    assert (r.sm_active, r.sm_occupancy, r.tensor_active) == (0.62, 0.25, 0.40)
    assert r.xid_errors == 0 and not r.lost
    procs = {p.pid: p for p in r.processes}
    assert procs[4242].mem_used == 12 * GiB and procs[4242].sm_util == 0.80
    # NVML had no memory figure for 4343 (missing) and no utilisation sample (ran no kernel: 0)
    assert procs[4343].mem_used is None and procs[4343].sm_util == 0.0
    src.close()
    assert fake.initialized == 0


def test_unavailable_metrics_are_missing_and_never_fail_the_sample(fake: FakeNVML) -> None:
    src = NvmlSource()
    src.sample()
    r = src.sample()[1]
    assert r.power_w is None and r.ecc_errors is None and r.temperature_c is None
    assert (r.sm_active, r.sm_occupancy, r.tensor_active) == (None, None, None)  # no GPM on this GPU
    assert r.gpu_util == 0.0 and r.mem_total == 80 * GiB  # what it can read, it reports
    # utilisation per process is not supported: SM util missing, memory still there
    assert [(p.pid, p.mem_used, p.sm_util) for p in r.processes] == [(5000, GiB, None)]
    # "not supported" is asked once; "no permission" is asked again (permissions can change)
    calls = fake.calls["nvmlDeviceGetPowerUsage"], fake.calls["nvmlDeviceGetTemperature"]
    src.sample()
    assert fake.calls["nvmlDeviceGetPowerUsage"] == calls[0] + 1  # GPU 0 only
    assert fake.calls["nvmlDeviceGetTemperature"] == calls[1] + 2  # both GPUs


def test_a_gpm_metric_the_gpu_lacks_is_missing_alone(fake: FakeNVML) -> None:
    del fake.gpus[0].gpm[pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL]
    src = NvmlSource()
    src.sample()
    r = src.sample()[0]
    assert (r.sm_active, r.sm_occupancy, r.tensor_active) == (0.62, 0.25, None)


def test_first_sample_has_no_gpm_rate_yet(fake: FakeNVML) -> None:
    r = NvmlSource().sample()[0]
    assert r.sm_active is None and r.gpu_util == 0.87


def test_lost_gpu_is_marked_and_the_others_carry_on(fake: FakeNVML) -> None:
    src = NvmlSource()
    src.sample()
    fake.gpus[0].lost = True
    lost, other = src.sample()
    assert lost.lost and lost.gpu_util is None and lost.processes == []
    assert not other.lost and other.gpu_util == 0.0 and [p.pid for p in other.processes] == [5000]
    fake.gpus[0].lost = False  # back on the bus (after a reset): read again
    assert not src.sample()[0].lost


def test_a_gpu_lost_before_start_still_gets_a_device_and_a_lost_reading(monkeypatch) -> None:
    fake = FakeNVML([FakeGPU(lost=True), FakeGPU()])
    monkeypatch.setattr(nvml_mod, "pynvml", fake)
    src = NvmlSource()
    assert [d.uuid for d in src.devices()] == ["nvml-index-0", "GPU-fake-0001"]
    assert [r.lost for r in src.sample()] == [True, False]


def test_xid_events_are_counted_per_gpu(fake: FakeNVML) -> None:
    src = NvmlSource()
    fake.gpus[1].xid_events += [79, 48]
    first = src.sample()
    assert [r.xid_errors for r in first] == [0, 2]
    fake.gpus[0].xid_events.append(13)
    assert [r.xid_errors for r in src.sample()] == [1, 2]  # counted since the source opened


def test_old_driver_without_functions_gives_missing_metrics(monkeypatch) -> None:
    fake = FakeNVML([FakeGPU(unsupported={"nvmlDeviceGetCurrentClocksEventReasons"}, throttle_reasons=4)])
    monkeypatch.setattr(nvml_mod, "pynvml", fake)
    # the newer name is unsupported: the older one answers
    assert NvmlSource().sample()[0].throttle_reasons == 4
    # a function this fake (like an old driver) lacks raises FunctionNotFound, the way pynvml does
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        fake.nvmlDeviceGetBAR1MemoryInfo(None)


@pytest.mark.parametrize("kw", [{"library_missing": True}, {"driver_missing": True}])
def test_no_driver_raises_source_unavailable(monkeypatch, kw) -> None:
    monkeypatch.setattr(nvml_mod, "pynvml", FakeNVML([], **kw))
    with pytest.raises(SourceUnavailable, match="FLEETLENS_SOURCE=cpu") as err:
        NvmlSource()
    assert isinstance(err.value.__cause__, pynvml.NVMLError)


def test_real_pynvml_on_this_machine_is_a_clear_error_or_the_source() -> None:
    error = nvml_init_error()
    if error is not None:
        # no driver here: the real library raises, the source turns it into a clear error that keeps the cause
        with pytest.raises(SourceUnavailable, match="FLEETLENS_SOURCE=cpu") as err:
            NvmlSource()
        assert type(err.value.__cause__) is type(error)
        return
    src = NvmlSource()  # a GPU host: the real source starts and reads its devices
    try:
        assert src.devices() and len(src.sample()) == len(src.devices())
    finally:
        src.close()


def test_the_fake_uses_the_real_error_classes() -> None:
    fake = FakeNVML([FakeGPU(lost=True)])
    fake.nvmlInit()
    handle = fake.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        fake.nvmlDeviceGetUtilizationRates(handle)
    assert fake.NVMLError is pynvml.NVMLError and fake.NVML_CLOCK_SM == pynvml.NVML_CLOCK_SM


def test_benchmark_fleet_eight_gpus_thirty_two_processes(monkeypatch) -> None:
    monkeypatch.setattr(nvml_mod, "pynvml", fleet(8, 32))
    src = NvmlSource()
    src.sample()
    readings = src.sample()
    assert len(readings) == 8 and all(len(r.processes) == 32 for r in readings)
    assert all(r.sm_active == 0.45 and r.tensor_active == 0.125 for r in readings)


def test_a_read_before_the_driver_s_next_sample_period_leaves_a_busy_process_unknown_not_idle(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # the driver ends a sample period every second read: every other read, NVML has nothing newer (NOT_FOUND)
    busy = FakeGPU(gpu_util=90, util_period_reads=2, processes=[FakeProcess(pid=10, sm_util=85)])
    idle = FakeGPU(gpu_util=0, util_period_reads=2, processes=[FakeProcess(pid=20, sm_util=None)])
    fake = FakeNVML([busy, idle])
    monkeypatch.setattr(nvml_mod, "pynvml", fake)
    src = NvmlSource()
    seen = [[(p.pid, p.sm_util) for r in src.sample() for p in r.processes] for _ in range(4)]
    src.close()
    assert fake.calls["nvmlDeviceGetProcessUtilization"] >= 8
    # reads 1, 2 and 4 see a new period; read 3 none: the busy GPU's process is unknown then, never 0
    assert [s[0] for s in seen] == [(10, 0.85), (10, 0.85), (10, None), (10, 0.85)]
    # on an idle device, nothing newer means its processes ran no kernel
    assert [s[1] for s in seen] == [(20, 0.0)] * 4
