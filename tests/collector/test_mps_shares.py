"""MPS as NVIDIA documents it, against a stand-in nvidia-cuda-mps-control and stand-in CUDA clients started the way
the agent starts lane jobs: each client's effective active thread percentage, by NVIDIA's rule (its own
CUDA_MPS_ACTIVE_THREAD_PERCENTAGE "can only further constrain" the daemon's default), is its lane's share; no job
starts before the daemon's control pipe exists; a job names its GPU by UUID and gets a pinned memory limit; the
lanes' GPUs are EXCLUSIVE_PROCESS while the daemon runs (through the fake NVML), and put back."""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pynvml
import pytest
from sqlalchemy import select

from collector.launch import job_env, spawn_job
from collector.mps import MpsSupervisor
from store.db import Store
from store.errors import InvalidInput
from store.models import HostEvent
from store.registry import busy_gpu_lanes, register_host
from store.settings import Settings
from tests.collector.test_mps import HOST, StandIn, _daemons_of, _gpu_lane
from tests.fakes.fake_pynvml import FakeGPU, FakeNVML

# a CUDA client: what it would connect to, and with which share, at the moment it creates its context (its start)
CLIENT = """
import json, os, sys
pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "")
default = os.path.join(pipe, "default")
json.dump({"control": os.path.exists(os.path.join(pipe, "control")),
           "default": int(open(default).read()) if os.path.exists(default) else None,
           "client": int(os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"]),
           "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
           "pinned": os.environ.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")}, open(sys.argv[1], "w"))
"""


def nvidia_effective(client: int, daemon_default: int | None) -> int:
    """NVIDIA's rule: the client's variable only lowers the daemon's setting (100 when it was never set)."""
    return min(client, 100 if daemon_default is None else daemon_default)


@pytest.fixture
def host_store(sqlite_store: Store) -> Store:
    with sqlite_store.session() as session:
        register_host(session, HOST, hostname="h", source="nvml")
    return sqlite_store


@pytest.fixture
def daemon_bin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fleet_home: Path) -> Iterator[Path]:
    stand_in = StandIn(tmp_path)  # test_mps's stand-in daemon: it keeps the default it is told in the pipe folder
    path = stand_in.install()
    monkeypatch.setenv("PATH", f"{stand_in.bin}{os.pathsep}{os.environ['PATH']}")
    yield path
    left = _daemons_of(Settings().mps_pipe_dir)
    for proc in left:
        proc.kill()
    assert not left, f"MPS daemons left running: {[p.pid for p in left]}"


def _supervisor(store: Store) -> MpsSupervisor:
    settings = Settings()
    return MpsSupervisor(settings.mps_binary, settings.mps_pipe_dir, settings.mps_log_dir, store=store, host_id=HOST)


def _launch(store: Store, workflow: str, device_id: int, lane_id: int, out: Path, **kw) -> dict:
    settings = Settings(mps=True)
    with store.session() as session:
        env, cores = job_env(session, workflow, [device_id], lane_id, host_id=HOST, mps_dirs=settings.mps_dirs)
    proc = spawn_job([sys.executable, "-c", CLIENT, str(out)], str(out.parent), env, cores=cores, detach=False,
                     **kw)
    assert proc.wait(timeout=60) == 0
    return json.loads(out.read_text())


def test_each_lanes_clients_get_their_own_share_by_nvidias_rule(daemon_bin, host_store, tmp_path) -> None:
    big = _gpu_lane(host_store, 0.7, device_index=3)
    small = _gpu_lane(host_store, 0.3, device_index=4)
    sup = _supervisor(host_store)
    try:
        with host_store.session() as session:
            sup.check(busy_gpu_lanes(session, HOST))
        seen = {share: _launch(host_store, wf, device, lane, tmp_path / f"{wf}.json")
                for share, (device, lane, wf) in ((70, big), (30, small))}
    finally:
        sup.close()
    for share, client in seen.items():
        assert client["control"] and client["client"] == share
        assert nvidia_effective(client["client"], client["default"]) == share, client
    # a client that lost its environment gets no more than the largest lane was given
    assert nvidia_effective(100, seen[70]["default"]) == 70
    # the GPU by UUID (NVML's index need not be CUDA's), and a pinned memory cap of the job's share (the lane's 8 GiB)
    assert seen[70]["visible"] == "GPU-mps-3" and seen[30]["visible"] == "GPU-mps-4"
    assert seen[70]["pinned"] == "0=8192M"


def test_no_job_starts_before_the_daemons_pipe_exists(daemon_bin, host_store, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("STANDIN_READY_DELAY_S", "1.5")  # the daemon takes a while to open its pipe
    device, lane, wf = _gpu_lane(host_store, 0.5, device_index=5)
    sup, stop = _supervisor(host_store), threading.Event()
    thread = threading.Thread(target=sup.run, args=(stop, 0.2), kwargs={"lanes": lambda: {lane: 0.5}})
    thread.start()  # the agent's MPS thread; the launch below comes at once, as a placement's launch does
    try:
        client = _launch(host_store, wf, device, lane, tmp_path / "early.json")
    finally:
        stop.set()
        thread.join(timeout=60)
    assert client["control"], "the job started before the MPS daemon's pipe existed: it would run outside MPS"
    assert nvidia_effective(client["client"], client["default"]) == 50


def test_a_launch_with_no_daemon_to_reach_is_refused_and_nothing_starts(daemon_bin, host_store, tmp_path) -> None:
    device, lane, wf = _gpu_lane(host_store, 0.5, device_index=6)
    out = tmp_path / "never.json"
    with pytest.raises(InvalidInput, match="runs outside MPS"):
        _launch(host_store, wf, device, lane, out, mps_wait_s=0.5)
    assert not out.exists()


def test_the_lanes_gpus_are_exclusive_to_mps_while_it_runs_and_put_back(daemon_bin, host_store) -> None:
    # NVIDIA advises EXCLUSIVE_PROCESS under MPS: only the MPS server opens a context, so nothing runs beside the lanes
    fake = FakeNVML([FakeGPU(uuid="GPU-mps-3"),
                     FakeGPU(uuid="GPU-other", compute_mode=pynvml.NVML_COMPUTEMODE_PROHIBITED)])
    settings = Settings()
    sup = MpsSupervisor(settings.mps_binary, settings.mps_pipe_dir, settings.mps_log_dir, store=host_store,
                        host_id=HOST, exclusive=True, nvml=fake)
    sup.check({1: 0.7}, devices={1: "GPU-mps-3"})
    assert sup.state == "running"
    assert [g.compute_mode for g in fake.gpus] == [pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS,
                                                   pynvml.NVML_COMPUTEMODE_PROHIBITED]  # only the lane's GPU
    sup.check({})
    assert sup.proc is None and fake.gpus[0].compute_mode == pynvml.NVML_COMPUTEMODE_DEFAULT  # put back
    assert fake.initialized == 0


def test_without_root_the_mode_is_said_once_and_the_lanes_run(daemon_bin, host_store) -> None:
    fake = FakeNVML([FakeGPU(uuid="GPU-mps-3", denied={"nvmlDeviceSetComputeMode"})])
    settings = Settings()
    sup = MpsSupervisor(settings.mps_binary, settings.mps_pipe_dir, settings.mps_log_dir, store=host_store,
                        host_id=HOST, exclusive=True, nvml=fake)
    try:
        sup.check({1: 0.7}, devices={1: "GPU-mps-3"})
        sup.check({1: 0.7}, devices={1: "GPU-mps-3"})
        assert sup.state == "running" and fake.gpus[0].compute_mode == pynvml.NVML_COMPUTEMODE_DEFAULT
    finally:
        sup.close()
    with host_store.session() as session:
        said = [e.message for e in session.scalars(select(HostEvent)) if "EXCLUSIVE_PROCESS" in e.message]
    assert len(said) == 1 and "nvidia-smi -i GPU-mps-3 -c EXCLUSIVE_PROCESS" in said[0]


def test_the_modes_are_put_back_by_the_agent_after_one_that_was_killed(daemon_bin, host_store) -> None:
    """The mode a GPU had before MPS is kept in the pipe folder: an agent that was killed (SIGKILL, OOM killer) left
    its GPUs in EXCLUSIVE_PROCESS, and the next one, which finds them so, must not take that for the mode to put
    back."""
    fake = FakeNVML([FakeGPU(uuid="GPU-mps-3")])
    settings = Settings()

    def supervisor() -> MpsSupervisor:
        return MpsSupervisor(settings.mps_binary, settings.mps_pipe_dir, settings.mps_log_dir, store=host_store,
                             host_id=HOST, exclusive=True, nvml=fake)

    supervisor().check({1: 0.7}, devices={1: "GPU-mps-3"})  # then killed: nothing of it runs its close()
    assert fake.gpus[0].compute_mode == pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
    after = supervisor()
    after.check({1: 0.7}, devices={1: "GPU-mps-3"})
    after.check({})
    assert fake.gpus[0].compute_mode == pynvml.NVML_COMPUTEMODE_DEFAULT
    # and when the next agent finds no lane needing MPS at all
    supervisor().check({1: 0.7}, devices={1: "GPU-mps-3"})
    supervisor().check({})
    assert fake.gpus[0].compute_mode == pynvml.NVML_COMPUTEMODE_DEFAULT
    # and when its daemon did not outlive it either
    killed = supervisor()
    killed.check({1: 0.7}, devices={1: "GPU-mps-3"})
    killed.proc.kill()
    killed.proc.wait()
    supervisor().check({})
    assert fake.gpus[0].compute_mode == pynvml.NVML_COMPUTEMODE_DEFAULT and fake.initialized == 0
