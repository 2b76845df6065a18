"""The nvml source against the driver generations and hardware a real fleet has, at the pynvml boundary: memory
v2 against v1 (an idle GPU is not held), nvidia-ml-py's NVMLLibraryMismatchError on an older driver, a GPU that
fails at start-up, and MIG devices opened as devices of their own, with their activity, and refreshed on change."""

from __future__ import annotations

import logging

import pynvml
import pytest

import collector.sources as sources
import collector.sources.nvml as nvml_mod
from collector.sources.nvml import NvmlSource
from store.settings import Settings
from tests.fakes.fake_pynvml import FakeGPU, FakeNVML, FakeProcess, GiB

MiB = 1 << 20
MIG_INDEX_BASE = 1000  # a MIG device's index: 1000 x (its GPU's index + 1) + its MIG index
IDLE_A100 = dict(memory_total=80 * GiB, memory_used=8 * MiB, memory_reserved=900 * MiB)  # v1: ~0.9 GB, v2: 8 MB


def _use(monkeypatch: pytest.MonkeyPatch, fake: FakeNVML) -> FakeNVML:
    monkeypatch.setattr(nvml_mod, "pynvml", fake)
    return fake


def test_an_idle_gpu_reads_its_v2_memory_not_the_drivers_reservation(monkeypatch) -> None:
    _use(monkeypatch, FakeNVML([FakeGPU(**IDLE_A100)]))
    src = NvmlSource()
    (r,) = src.sample()
    assert r.mem_used == 8 * MiB and r.mem_total == 80 * GiB  # below any "held" threshold (0.25 GiB)
    assert src.memory_api == {0: "v2"}


def test_a_driver_without_memory_v2_falls_back_to_v1_and_says_so(monkeypatch, caplog) -> None:
    fake = _use(monkeypatch, FakeNVML([FakeGPU(**IDLE_A100)], memory_v2=False))
    caplog.set_level(logging.INFO, logger="collector.sources.nvml")
    src = NvmlSource()
    assert src.devices()[0].memory_total == 80 * GiB
    (r,) = src.sample()
    assert r.mem_used == 908 * MiB and src.memory_api == {0: "v1"}
    assert "nvmlDeviceGetMemoryInfo_v2" in caplog.text
    v2_calls = fake.calls["nvmlDeviceGetMemoryInfo_v2"]
    src.sample()
    assert fake.calls["nvmlDeviceGetMemoryInfo_v2"] == v2_calls  # not asked again


def test_an_older_driver_than_the_binding_still_lists_processes(monkeypatch) -> None:
    # nvidia-ml-py 13's unversioned call raises NVMLLibraryMismatchError (not an NVMLError) without _v3
    fake = _use(monkeypatch, FakeNVML([FakeGPU(processes=[FakeProcess(pid=77, used_memory=3 * GiB, sm_util=50)])],
                                      process_api=2))
    with pytest.raises(pynvml.NVMLLibraryMismatchError):
        fake.nvmlInit(), fake.nvmlDeviceGetComputeRunningProcesses(fake.nvmlDeviceGetHandleByIndex(0))
    src = NvmlSource()
    for _ in range(3):
        (r,) = src.sample()
        assert not r.lost and r.gpu_util == 0.0
        assert [(p.pid, p.mem_used, p.sm_util) for p in r.processes] == [(77, 3 * GiB, 0.5)]
    assert fake.calls["nvmlDeviceGetComputeRunningProcesses_v2"] == 3
    assert fake.calls["nvmlDeviceGetComputeRunningProcesses_v3"] <= 1  # found missing once, then not asked


def test_one_gpu_failing_at_start_up_is_listed_lost_and_the_host_stays_a_gpu_host(monkeypatch, caplog) -> None:
    _use(monkeypatch, FakeNVML([FakeGPU(handle_error=pynvml.NVML_ERROR_UNKNOWN), FakeGPU(memory_used=GiB)]))
    monkeypatch.setattr(sources, "_nvml", lambda: NvmlSource())
    caplog.set_level(logging.WARNING)
    src = sources.open_source(Settings(source="auto"))
    try:
        assert src.name == "nvml"
        assert [d.uuid for d in src.devices()] == ["nvml-index-0", "GPU-fake-0001"]
        assert [(r.lost, r.mem_used) for r in src.sample()] == [(True, None), (False, GiB)]
        assert "cannot open GPU 0" in caplog.text
    finally:
        src.close()


def test_a_driver_that_cannot_list_its_gpus_is_said_as_a_warning(monkeypatch, caplog) -> None:
    fake = _use(monkeypatch, FakeNVML([FakeGPU()]))
    monkeypatch.setattr(fake, "nvmlDeviceGetCount", lambda: (_ for _ in ()).throw(
        pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)), raising=False)
    monkeypatch.setattr(sources, "_nvml", lambda: NvmlSource())
    caplog.set_level(logging.INFO)
    src = sources.open_source(Settings(source="auto"))
    try:
        assert src.name == "cpu"
        assert [r.levelno for r in caplog.records if "sampling CPU cores instead" in r.getMessage()] == [
            logging.WARNING]
    finally:
        src.close()


def _mig_gpu() -> FakeGPU:
    gr = pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL
    return FakeGPU(name="NVIDIA A100-SXM4-40GB", memory_total=40 * GiB, sm_count=98, gpm={}, mig=[
        FakeGPU(uuid="MIG-aaaa", name="NVIDIA A100-SXM4-40GB MIG 3g.20gb", memory_total=20 * GiB,
                memory_used=5 * GiB, gpu_instance_id=1, sm_count=42, slices=3,
                gpm={gr: 75.0, pynvml.NVML_GPM_METRIC_SM_UTIL: 60.0},
                processes=[FakeProcess(pid=901, used_memory=5 * GiB)]),
        FakeGPU(uuid="MIG-bbbb", name="NVIDIA A100-SXM4-40GB MIG 1g.5gb", memory_total=5 * GiB,
                gpu_instance_id=9, sm_count=14, gpm={gr: 0.0}),
    ])


def test_mig_devices_are_devices_of_their_own_with_their_weight_and_activity(monkeypatch) -> None:
    fake = _use(monkeypatch, FakeNVML([_mig_gpu(), FakeGPU(memory_used=GiB)]))
    src = NvmlSource()
    infos = src.devices()
    assert [(d.index, d.uuid, d.parent_uuid, d.memory_total) for d in infos] == [
        (MIG_INDEX_BASE, "MIG-aaaa", "GPU-fake-0000", 20 * GiB),
        (MIG_INDEX_BASE + 1, "MIG-bbbb", "GPU-fake-0000", 5 * GiB),
        (1, "GPU-fake-0001", None, 80 * GiB),
    ]
    # NVML's own MIG device names (model and profile), which the analyzer weighs held hours by
    assert [d.name for d in infos[:2]] == ["NVIDIA A100-SXM4-40GB MIG 3g.20gb", "NVIDIA A100-SXM4-40GB MIG 1g.5gb"]
    assert infos[0].slice_weight == pytest.approx(42 / 98) and infos[1].slice_weight == pytest.approx(14 / 98)
    assert infos[2].slice_weight is None
    src.sample()  # GPM: the first sample starts the clock
    busy, idle, whole = src.sample()
    # utilisation is not supported on MIG: the GPU instance's graphics-engine activity stands for it
    assert (busy.index, busy.gpu_util, busy.sm_active, busy.mem_used) == (MIG_INDEX_BASE, 0.75, 0.60, 5 * GiB)
    assert [p.pid for p in busy.processes] == [901] and busy.processes[0].mem_used == 5 * GiB
    assert (idle.gpu_util, idle.mem_used) == (0.0, 0)
    assert whole.gpu_util == 0.0 and whole.mem_used == GiB
    assert fake.calls["nvmlDeviceGetUtilizationRates"] == 2  # the whole GPU only: never asked of a MIG handle


def test_a_mig_slice_weight_needs_no_privileges_and_falls_back_to_slices_then_memory(monkeypatch) -> None:
    """NVML answers nvmlDeviceGetAttributes for MIG handles only, and the parent's memory in MIG mode only to a
    privileged caller: the whole GPU's figures come from its largest GPU-instance profile."""
    def weights(gpu: FakeGPU) -> list[float | None]:
        _use(monkeypatch, FakeNVML([gpu]))
        return [d.slice_weight for d in NvmlSource().devices()]

    unprivileged = _mig_gpu()
    unprivileged.denied.add("nvmlDeviceGetMemoryInfo")  # the parent's, in MIG mode: not for an ordinary user
    assert weights(unprivileged) == pytest.approx([42 / 98, 14 / 98])
    no_sms = _mig_gpu()  # a driver that reports no SM count for the slice: its GPU-instance slices of the 7
    for mig in no_sms.mig:
        mig.sm_count = 0
    assert weights(no_sms) == pytest.approx([3 / 7, 1 / 7])
    a30 = _mig_gpu()  # an A30: its whole GPU is the 4-slice profile
    a30.gi_profiles = {pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE: 1, pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE: 2,
                       pynvml.NVML_GPU_INSTANCE_PROFILE_4_SLICE: 4}
    assert weights(a30) == pytest.approx([42 / 98, 14 / 98])  # the fake's 4-slice profile has all 98 SMs
    old_driver = _mig_gpu()  # no V call: the v1 struct is asked for
    old_driver.unsupported.add("nvmlDeviceGetGpuInstanceProfileInfoV")
    assert weights(old_driver) == pytest.approx([42 / 98, 14 / 98])
    no_profiles = _mig_gpu()  # no profile answered: the memory share, where the parent's memory may be read
    no_profiles.unsupported.add("nvmlDeviceGetGpuInstanceProfileInfo")
    assert weights(no_profiles) == pytest.approx([20 / 40, 5 / 40])
    no_profiles.denied.add("nvmlDeviceGetMemoryInfo")
    assert weights(no_profiles) == [None, None]


def test_mig_reconfigured_is_seen_and_the_new_devices_read(monkeypatch) -> None:
    fake = _use(monkeypatch, FakeNVML([FakeGPU(gpm={pynvml.NVML_GPM_METRIC_SM_UTIL: 10.0})]))
    src = NvmlSource(refresh_s=3600)
    assert [d.uuid for d in src.devices()] == ["GPU-fake-0000"]
    src.sample()
    fake.gpus[0].mig = _mig_gpu().mig  # MIG turned on and two instances made
    fake.reconfigure()
    assert src.refresh() is True and src.refreshes == 1
    assert [d.uuid for d in src.devices()] == ["MIG-aaaa", "MIG-bbbb"]
    src.sample()
    first = src.sample()
    assert [r.index for r in first] == [MIG_INDEX_BASE, MIG_INDEX_BASE + 1]
    assert first[0].gpu_util == 0.75 and not first[0].lost
    # an instance destroyed: its stale handle answers InvalidArgument, and the next sample enumerates again
    fake.gpus[0].mig = fake.gpus[0].mig[:1]
    fake.reconfigure()
    src.sample()
    after = src.sample()
    assert [d.uuid for d in src.devices()] == ["MIG-aaaa"] and src.refreshes == 2
    assert [(r.index, r.mem_used) for r in after] == [(MIG_INDEX_BASE, 5 * GiB)]
    src.close()
