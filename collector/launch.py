"""Starting and finding managed jobs' processes: the environment a job runs with, spawning it (pinned to its cores
from its first instruction on `cpu` devices), and finding its live processes again by that environment.

`job_env` computes from the store: FLEETLENS_WORKFLOW, FLEETLENS_MANAGED (the host id), CUDA_VISIBLE_DEVICES (GPU
UUIDs, which mean the same GPU to NVML and to CUDA whatever CUDA's enumeration order; CPU affinity on `cpu`
devices), and for a lane FLEETLENS_LANE, FLEETLENS_MEMORY_FRACTION, FLEETLENS_IDLE_MEMORY_FRACTION and
CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (plus, on GPUs of a fleet that runs MPS, the daemon's CUDA_MPS_PIPE_DIRECTORY and
CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, which caps a job that does not use the SDK as well).
The memory fractions are the job's own admitted share of the device, not the lane's size: P' + E during its turn,
P' outside it (the SDK switches between them and releases its cached memory at each turn's end), so the caps in
force at any moment sum to at most ΣP' + max E, the lane. A share given without its parts is one cap for both.
Whoever starts a job on a GPU of an MPS fleet waits for the daemon's control pipe first (`spawn_job`): a process
that creates its CUDA context before the pipe exists runs outside MPS for its whole life.
Whoever starts a job (`fleetlens run` in the foreground, or the agent for a detached launch or a relaunch) uses
`spawn_job` with it.
"""

from __future__ import annotations

import math
import os
import shlex
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import psutil
from sqlalchemy import select
from sqlalchemy.orm import Session

from collector.mps import mps_env, thread_percentage
from store.errors import InvalidInput, NotFound
from store.headroom import charged
from store.models import Device, Lane, Placement, Workflow

MANAGED_ENV = "FLEETLENS_MANAGED"  # set to the host id in every managed job's environment: how agents find it
MPS_PIPE_WAIT_S = 30.0  # how long a launch waits for the host's MPS daemon to open its control pipe
_GONE = (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess)


def job_env(session: Session, workflow_id: str, device_ids: Sequence[int], lane_id: int | None, *,
            host_id: str, resume_from: str | None = None, resume_step: int | None = None,
            share_bytes: int | None = None, mps_dirs: tuple[Path, Path] | None = None,
            ) -> tuple[dict[str, str], list[int] | None]:
    """(environment overrides, cpu cores to pin to or None) for running the workflow on these devices / lane.

    `share_bytes` is the job's admitted memory in the lane (P' + E); by default that of its pending or active
    placement in the lane. Raises InvalidInput when that share is smaller than the job's measured persistent memory
    (it would run out of memory at once). `mps_dirs` (pipe, log folder) when the fleet runs MPS: a job in a lane on
    GPUs then reaches the host's daemon."""
    devices = [session.get(Device, d) for d in device_ids]
    if any(d is None for d in devices):
        raise NotFound(f"device {device_ids} is no longer in the store")
    wf = session.get(Workflow, workflow_id)
    env = {str(k): str(v) for k, v in ((wf.spec_env if wf is not None else None) or {}).items()}
    env.update({"FLEETLENS_WORKFLOW": workflow_id, MANAGED_ENV: host_id})
    cores: list[int] | None = None
    if all(d.source == "cpu" for d in devices):
        cores = sorted({int(c) for d in devices for c in (d.cpu_cores or [])}) or None
        env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU device: the job must not wander onto a GPU it was not given
    else:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(_cuda_name(d) for d in devices)
    if lane_id is not None:
        lane = session.get(Lane, lane_id)
        if lane is None:
            raise NotFound(f"lane {lane_id} is no longer in the store")
        total = devices[0].memory_total or 0
        share = job_share(session, workflow_id, lane, share_bytes)
        fraction = min(1.0, share / total) if total else 1.0
        env.update(FLEETLENS_LANE=str(lane_id), FLEETLENS_MEMORY_FRACTION=f"{max(fraction, 1e-6):.6f}",
                   CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=str(thread_percentage(lane.compute_share)[0]))
        persistent = _admitted_persistent(session, workflow_id, lane) if share_bytes is None else None
        if persistent is not None and total and persistent < share:
            # floor, not round: the caps of a lane's jobs must add up to no more than the lane
            env["FLEETLENS_IDLE_MEMORY_FRACTION"] = f"{max(math.floor(persistent / total * 1e6) / 1e6, 1e-6):.6f}"
        if mps_dirs is not None and cores is None:
            env.update(mps_env(*mps_dirs))
            # device ordinals as the job sees them: its CUDA_VISIBLE_DEVICES lists its devices from 0
            env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = ",".join(
                f"{k}={max(1, share >> 20)}M" for k in range(len(devices)))
    if resume_from:
        env["FLEETLENS_RESUME_FROM"] = str(resume_from)
    if resume_step is not None:
        env["FLEETLENS_RESUME_STEP"] = str(int(resume_step))
    return env, cores


def _cuda_name(device: Device) -> str:
    """How CUDA_VISIBLE_DEVICES names a GPU: its UUID (NVML's index need not be CUDA's), else its index."""
    uuid = device.uuid or ""
    return uuid if uuid.startswith(("GPU-", "MIG-")) else str(device.index)


def _admitted_persistent(session: Session, workflow_id: str, lane: Lane) -> int | None:
    """P' of the job's pending or active placement in the lane (None when it has no measured share)."""
    placement = session.scalar(select(Placement).where(
        Placement.workflow_id == workflow_id, Placement.lane_id == lane.id,
        Placement.state.in_(("pending", "active"))).order_by(Placement.id.desc()).limit(1))
    if placement is None or placement.mem_persistent is None or not placement.mem_ephemeral:
        return None
    return charged(int(placement.mem_persistent))


def job_share(session: Session, workflow_id: str, lane: Lane, share_bytes: int | None = None) -> int:
    """The bytes of `lane` this job may use: its admitted P' + E (the given share, else its placement's), never
    more than the lane; refuses a share below the persistent GPU memory the SDK measured for the job."""
    if share_bytes is None:
        placement = session.scalar(select(Placement).where(
            Placement.workflow_id == workflow_id, Placement.lane_id == lane.id,
            Placement.state.in_(("pending", "active"))).order_by(Placement.id.desc()).limit(1))
        if placement is not None and placement.mem_persistent is not None:
            share_bytes = charged(int(placement.mem_persistent)) + int(placement.mem_ephemeral or 0)
    share = min(int(share_bytes), lane.size_bytes) if share_bytes else lane.size_bytes
    wf = session.get(Workflow, workflow_id)
    # only GPU memory the SDK measured is comparable with a share of a GPU (host RSS on a CPU device is not)
    measured = wf is not None and (wf.labels or {}).get("mem_source") == "cuda" and wf.mem_persistent
    if measured and share < wf.mem_persistent:
        raise InvalidInput(
            f"{workflow_id}'s share of lane {lane.id} is {share} bytes, less than the {wf.mem_persistent} bytes of "
            "persistent memory it was measured to hold; place it in a bigger lane or on a whole device")
    return share


def spawn_job(command: Sequence[str], cwd: str, env_overrides: dict[str, str], *, cores: list[int] | None = None,
              log_path: str | os.PathLike[str] | None = None, detach: bool = True,
              base_env: dict[str, str] | None = None, mps_wait_s: float = MPS_PIPE_WAIT_S) -> subprocess.Popen:
    """Start the job: its own session when detached (it outlives whoever started it), output to `log_path`.
    A job given an MPS pipe folder starts only once the daemon's control pipe is there (see wait_for_mps_pipe)."""
    env = dict(os.environ if base_env is None else base_env)
    for key in ("FLEETLENS_WORKFLOW", "FLEETLENS_LANE", "FLEETLENS_MEMORY_FRACTION", "FLEETLENS_RESUME_FROM",
                "FLEETLENS_RESUME_STEP", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_MPS_PIPE_DIRECTORY",
                "CUDA_MPS_LOG_DIRECTORY", "FLEETLENS_IDLE_MEMORY_FRACTION", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"):
        env.pop(key, None)  # never inherit another job's identity or lane
    env.update(env_overrides)
    if "CUDA_MPS_PIPE_DIRECTORY" in env_overrides:
        wait_for_mps_pipe(Path(env_overrides["CUDA_MPS_PIPE_DIRECTORY"]), command, mps_wait_s)
    out: IO[bytes] | int | None = None
    if log_path is not None:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        out = open(log_path, "ab")  # noqa: SIM115 (handed to the child; closed below)
    try:
        with _pinned(cores, command):
            proc = subprocess.Popen(list(command), cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=subprocess.STDOUT if out is not None else None,
                                    start_new_session=detach)
    except OSError as exc:
        raise InvalidInput(f"cannot start {shlex.join(command)} in {cwd}: {exc.strerror or exc}") from None
    finally:
        if out is not None and not isinstance(out, int):
            out.close()
    return proc


def wait_for_mps_pipe(pipe_dir: Path, command: Sequence[str], timeout_s: float) -> None:
    """Wait until the MPS control daemon serving `pipe_dir` has opened its control pipe (the agent's MPS thread
    starts it once the job's lane is in the store); refuse to start the job when it has not within `timeout_s`."""
    control = pipe_dir / "control"
    deadline = time.monotonic() + timeout_s
    while not control.exists():
        if time.monotonic() >= deadline:
            raise InvalidInput(
                f"not starting {shlex.join(command)}: the MPS control daemon has not opened {control} in "
                f"{timeout_s:.0f} s, and a job that starts before it runs outside MPS (without its lane's compute "
                "share) for its whole life; check the agent's MPS events (FLEETLENS_MPS, nvidia-cuda-mps-control "
                "on the agent's PATH)")
        time.sleep(0.05)


@contextmanager
def _pinned(cores: list[int] | None, command: Sequence[str]) -> Iterator[None]:
    """Run the block with the calling thread confined to `cores`, so a process started in it is pinned from its
    first instruction (a child inherits its parent thread's CPU mask through fork and exec). Only this thread's
    mask changes, and it is put back: the agent's other threads, and a preexec hook's fork-safety, are untouched."""
    if not cores:
        yield
        return
    before = os.sched_getaffinity(0)  # pid 0: the calling thread
    try:
        os.sched_setaffinity(0, cores)
    except OSError as exc:
        raise InvalidInput(f"cannot pin {shlex.join(command)} to cpu cores {cores}: {exc.strerror or exc}; "
                           f"this host allows cores {sorted(before)}") from None
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def find_job_processes(workflow_id: str, host_id: str) -> list[psutil.Process]:
    """The live top-level processes of a managed workflow on this host (found by the environment
    `fleetlens run` gave them, so it works for jobs started by a previous agent or in the foreground)."""
    return find_managed_processes(host_id).get(workflow_id, [])


def find_managed_processes(host_id: str) -> dict[str, list[psutil.Process]]:
    """Every managed workflow's live top-level processes on this host, by workflow id, found by their environment
    (a job's own children carry the same environment; only the topmost of each is listed)."""
    found: dict[int, tuple[psutil.Process, str]] = {}
    for proc in psutil.process_iter(["pid", "status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            env = proc.environ()
        except _GONE:
            continue
        workflow = env.get("FLEETLENS_WORKFLOW")
        if workflow and env.get(MANAGED_ENV) == host_id:
            found[proc.pid] = (proc, workflow)
    top: dict[str, list[psutil.Process]] = {}
    for proc, workflow in found.values():
        try:
            parent = found.get(proc.ppid())
        except _GONE:
            continue
        if parent is None or parent[1] != workflow:
            top.setdefault(workflow, []).append(proc)
    return {wf: sorted(procs, key=lambda p: p.pid) for wf, procs in top.items()}
