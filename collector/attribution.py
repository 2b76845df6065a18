"""Which workflow a process belongs to, read from /proc: its environment, its cgroup, or its command line.

In order of trust:

1. ``FLEETLENS_WORKFLOW`` in /proc/PID/environ -> (value, "env"); the job named itself.
2. ``SLURM_JOB_ID`` in the environment -> ("slurm-<id>", "slurm"); or, when the environment cannot be read
   (another user's process), a Slurm job cgroup (``/slurm/uid_N/job_<id>/``) in /proc/PID/cgroup.
3. A Kubernetes pod uid in /proc/PID/cgroup (cgroupfs ``/kubepods/<qos>/pod<uid>/`` or systemd
   ``kubepods-<qos>-pod<uid_with_underscores>.slice``) -> ("k8s-<uid>", "k8s").
4. The command line -> ("cmd:<argv joined by spaces>", "cmdline"); long ones are cut and end in a hash so
   the id stays within the column and stays stable.

A process that has vanished, or whose files all deny reading, gives None; nothing is raised or logged.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

PROC = Path("/proc")
MAX_ID = 480  # workflows.id is 512 characters

_K8S_POD = re.compile(
    r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})", re.IGNORECASE
)
_SLURM_JOB = re.compile(r"/slurm[^/]*/uid_\d+/job_(\d+)(?:/|$)")


def parse_environ(raw: bytes) -> dict[str, str]:
    """/proc/PID/environ (NUL-separated KEY=VALUE) as a dict; undecodable bytes are replaced, not fatal."""
    env: dict[str, str] = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep and key:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def k8s_pod_uid(cgroup_text: str) -> str | None:
    """The Kubernetes pod uid in /proc/PID/cgroup text (v1 or v2, cgroupfs or systemd driver), dashed."""
    for line in cgroup_text.splitlines():
        path = line.split(":", 2)[-1]
        if "kubepods" not in path:
            continue
        match = _K8S_POD.search(path)
        if match:
            return match.group(1).replace("_", "-").lower()
    return None


def slurm_job_from_cgroup(cgroup_text: str) -> str | None:
    """A Slurm job id in /proc/PID/cgroup text (``.../slurm/uid_1000/job_42/step_0/...``)."""
    for line in cgroup_text.splitlines():
        match = _SLURM_JOB.search(line.split(":", 2)[-1])
        if match:
            return match.group(1)
    return None


def cmdline_id(argv: list[str]) -> str:
    text = " ".join(argv)
    if len(text) + 4 > MAX_ID:
        digest = hashlib.sha1(text.encode(errors="replace")).hexdigest()[:12]
        text = f"{text[: MAX_ID - 4 - 13]}#{digest}"
    return f"cmd:{text}"


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError, OSError):
        return None


def attribute(pid: int, *, proc: Path = PROC) -> tuple[str, str] | None:
    """(workflow id, id source) of `pid`, id source one of env | slurm | k8s | cmdline; None if unknowable."""
    base = proc / str(int(pid))
    raw_env = _read(base / "environ")
    if raw_env is not None:
        env = parse_environ(raw_env)
        workflow = env.get("FLEETLENS_WORKFLOW", "").strip()
        if workflow:
            return workflow[:MAX_ID], "env"
        job = env.get("SLURM_JOB_ID", "").strip()
        if job:
            return f"slurm-{job}", "slurm"
    raw_cgroup = _read(base / "cgroup")
    if raw_cgroup is not None:
        text = raw_cgroup.decode(errors="replace")
        if raw_env is None:
            job = slurm_job_from_cgroup(text)
            if job:
                return f"slurm-{job}", "slurm"
        uid = k8s_pod_uid(text)
        if uid:
            return f"k8s-{uid}", "k8s"
    raw_cmd = _read(base / "cmdline")
    if raw_cmd:
        argv = [a.decode(errors="replace") for a in raw_cmd.rstrip(b"\0").split(b"\0")]
        if any(argv):
            return cmdline_id(argv), "cmdline"
    comm = _read(base / "comm")  # kernel threads and zombies have no command line
    if comm:
        return f"cmd:[{comm.decode(errors='replace').strip()}]", "cmdline"
    return None
