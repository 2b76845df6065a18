"""Attribution of real child processes to workflows: environment, Slurm, Kubernetes cgroups, command line."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from collector.attribution import MAX_ID, attribute, k8s_pod_uid, parse_environ, slurm_job_from_cgroup

SLEEP = [sys.executable, "-c", "import time; time.sleep(30)"]


@pytest.fixture
def spawn() -> Iterator:
    children: list[subprocess.Popen] = []

    def start(env_extra: dict[str, str] | None = None, argv: list[str] | None = None) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if k not in ("FLEETLENS_WORKFLOW", "SLURM_JOB_ID")}
        env.update(env_extra or {})
        argv = argv or SLEEP
        child = subprocess.Popen(argv, env=env)
        children.append(child)
        # between fork and exec /proc shows the parent's (or no) command line: wait for the exec
        want = "\0".join(argv).encode()
        deadline = time.monotonic() + 10
        while Path(f"/proc/{child.pid}/cmdline").read_bytes().rstrip(b"\0") != want:
            assert time.monotonic() < deadline, "the child never exec'd"
            time.sleep(0.01)
        return child

    yield start
    for child in children:
        child.kill()
        child.wait()


def test_fleetlens_workflow_in_the_environment_wins(spawn) -> None:
    child = spawn({"FLEETLENS_WORKFLOW": "resnet-sweep-7", "SLURM_JOB_ID": "991"})
    assert attribute(child.pid) == ("resnet-sweep-7", "env")


def test_slurm_job_id_when_no_workflow_is_named(spawn) -> None:
    child = spawn({"SLURM_JOB_ID": "4711"})
    assert attribute(child.pid) == ("slurm-4711", "slurm")


def test_command_line_as_the_last_resort(spawn) -> None:
    child = spawn()
    workflow, source = attribute(child.pid)
    assert source == "cmdline"
    assert workflow == "cmd:" + " ".join(SLEEP)


def test_a_very_long_command_line_is_cut_stably(spawn) -> None:
    argv = [sys.executable, "-c", "import time; time.sleep(30)", *(["--flag=" + "x" * 50] * 20)]
    child = spawn(argv=argv)
    first = attribute(child.pid)
    assert first is not None and len(first[0]) <= MAX_ID and "#" in first[0]
    assert attribute(child.pid) == first


def test_a_vanished_process_gives_none_quietly(spawn) -> None:
    child = spawn()
    child.kill()
    child.wait()
    assert attribute(child.pid) is None
    assert attribute(2**22 + 12345) is None  # above pid_max: never existed


def test_unreadable_environment_falls_back_quietly(tmp_path, spawn) -> None:
    # another user's process: environ denied, cgroup and cmdline readable (a /proc tree copied from the child)
    child = spawn({"FLEETLENS_WORKFLOW": "hidden"})
    d = tmp_path / str(child.pid)
    d.mkdir()
    for name in ("cmdline", "cgroup"):
        (d / name).write_bytes(Path(f"/proc/{child.pid}/{name}").read_bytes())
    environ = d / "environ"
    environ.write_bytes(b"FLEETLENS_WORKFLOW=hidden\0")
    environ.chmod(0)
    if os.access(environ, os.R_OK):  # root ignores file modes: a missing file is the same denied read
        environ.unlink()
    assert attribute(child.pid, proc=tmp_path) == ("cmd:" + " ".join(SLEEP), "cmdline")
    # a Slurm job cgroup still names the job when its environment is hidden
    (d / "cgroup").write_text(CGROUP_SLURM_V1)
    assert attribute(child.pid, proc=tmp_path) == ("slurm-8812", "slurm")


# Real-format /proc/PID/cgroup lines, as written by the kernel under each Kubernetes cgroup driver.
CGROUP_V1_CGROUPFS = """\
12:pids:/kubepods/burstable/pod8f3f0a3c-1d2e-4b5a-9c8d-0123456789ab/3f2b8c0e9d1a4b7c8e6f5a4b3c2d1e0f9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c4d
11:memory:/kubepods/burstable/pod8f3f0a3c-1d2e-4b5a-9c8d-0123456789ab/3f2b8c0e9d1a4b7c8e6f5a4b3c2d1e0f9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c4d
1:name=systemd:/kubepods/burstable/pod8f3f0a3c-1d2e-4b5a-9c8d-0123456789ab/3f2b8c0e9d1a4b7c8e6f5a4b3c2d1e0f9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c4d
"""
CGROUP_V2_SYSTEMD = (
    "0::/kubepods.slice/kubepods-besteffort.slice/"
    "kubepods-besteffort-pod0a1b2c3d_4e5f_6789_abcd_ef0123456789.slice/"
    "cri-containerd-9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c4d3e2f1a0b9c8d7e6f5a4b3c2d1e0f9a8b.scope\n"
)
CGROUP_GUARANTEED = "0::/kubepods/podc0ffee00-1111-2222-3333-444455556666/abc\n"
CGROUP_SLURM = "0::/system.slice/slurmstepd.scope/job_8812/step_0/user/task_0\n"
CGROUP_SLURM_V1 = "4:memory:/slurm/uid_1000/job_8812/step_0/task_0\n"
CGROUP_PLAIN = "0::/user.slice/user-1000.slice/session-3.scope\n"


@pytest.mark.parametrize(
    ("text", "uid"),
    [
        (CGROUP_V1_CGROUPFS, "8f3f0a3c-1d2e-4b5a-9c8d-0123456789ab"),
        (CGROUP_V2_SYSTEMD, "0a1b2c3d-4e5f-6789-abcd-ef0123456789"),
        (CGROUP_GUARANTEED, "c0ffee00-1111-2222-3333-444455556666"),
        (CGROUP_PLAIN, None),
        (CGROUP_SLURM, None),
    ],
)
def test_kubernetes_pod_uid_from_real_cgroup_lines(text: str, uid: str | None) -> None:
    assert k8s_pod_uid(text) == uid


def test_slurm_job_from_a_v1_cgroup() -> None:
    assert slurm_job_from_cgroup(CGROUP_SLURM_V1) == "8812"
    assert slurm_job_from_cgroup(CGROUP_PLAIN) is None


def test_pod_cgroup_names_the_workflow_through_a_proc_tree(tmp_path, spawn) -> None:
    child = spawn()
    d = tmp_path / str(child.pid)
    d.mkdir()
    (d / "environ").write_bytes(b"PATH=/usr/bin\0HOME=/root\0")
    (d / "cgroup").write_text(CGROUP_V2_SYSTEMD)
    (d / "cmdline").write_bytes(b"python\0serve.py\0")
    assert attribute(child.pid, proc=tmp_path) == ("k8s-0a1b2c3d-4e5f-6789-abcd-ef0123456789", "k8s")


def test_environ_parsing_tolerates_odd_bytes() -> None:
    env = parse_environ(b"A=1\0B=x=y\0\xff\xfe=bad\0NOEQUALS\0\0FLEETLENS_WORKFLOW=w\xe9\0")
    assert env["A"] == "1" and env["B"] == "x=y" and env["FLEETLENS_WORKFLOW"].startswith("w")
