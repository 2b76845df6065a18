"""A real one-node Slurm 22.05 for the tests (../shared/slurm/local-cluster.sh), and what the tests do with it:
submit jobs (real batch scripts, real torch training jobs on the job SDK), read them back, cancel them."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from enforcer.actuators.slurm import TERMINAL, SlurmActuator

PROJECT_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = PROJECT_ROOT.parent / "shared" / "slurm" / "local-cluster.sh"
if not SCRIPT.exists():  # a worktree beside the main checkout
    SCRIPT = Path("/work/shared/slurm/local-cluster.sh")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _daemon_env() -> dict[str, str]:
    """The environment to start Slurm's daemons in: without a test's FLEETLENS_* variables, since the daemons outlive
    the test and each test's leftover processes are found by their FLEETLENS_HOME and killed."""
    return {k: v for k, v in os.environ.items() if not k.startswith("FLEETLENS_")}


def unavailable_reason() -> str | None:
    if shutil.which("slurmctld") is None or shutil.which("sbatch") is None:
        return "Slurm is not installed (make test installs slurm-wlm slurm-client munge from Debian)"
    if not SCRIPT.exists():
        return f"the cluster script {SCRIPT} is missing"
    return None


@dataclass
class Cluster:
    dir: Path
    env: dict[str, str] = field(default_factory=dict)
    shards: int = 8  # the node's gres/shard count, spread by Slurm over its 4 GPUs

    def start(self) -> None:
        extra = {"SLURM_LOCAL_CTLD_PORT": str(_free_port()), "SLURM_LOCAL_SLURMD_PORT": str(_free_port()),
                 "SLURM_LOCAL_CRED_EXPIRE": "5", "SLURM_LOCAL_SHARDS": str(self.shards)}
        out = subprocess.run([str(SCRIPT), "start", str(self.dir)], capture_output=True, text=True, timeout=120,
                             env={**_daemon_env(), **extra})
        if out.returncode != 0:
            raise RuntimeError(f"local-cluster.sh start failed: {out.stderr[-2000:]}")
        for line in out.stdout.splitlines():
            if line.startswith("export ") and "=" in line:
                key, _, value = line[len("export "):].partition("=")
                self.env[key] = value.strip("'\"")
        self.env.update(extra)

    def stop(self) -> None:
        subprocess.run([str(SCRIPT), "stop", str(self.dir)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, **self.env})

    def stop_ctld(self) -> None:
        """Stop slurmctld alone (its state is saved; slurmd, munged and the jobs run on)."""
        pid = int((self.dir / "run" / "slurmctld.pid").read_text().strip())
        proc = psutil.Process(pid)
        proc.terminate()
        proc.wait(timeout=30)

    def start_ctld(self) -> None:
        """Start slurmctld again from its saved state, as the script did, and wait until it answers."""
        subprocess.run([shutil.which("slurmctld") or "slurmctld", "-f", self.env["SLURM_CONF"]], check=True,
                       env={**_daemon_env(), **self.env}, timeout=60, capture_output=True)
        self.wait(lambda: subprocess.run(["squeue", "-h"], env={**os.environ, **self.env},
                                         capture_output=True).returncode == 0, timeout=30)

    @property
    def node(self) -> str:
        return self.env["SLURM_LOCAL_NODE"]

    def run(self, *argv: str, check: bool = True, env: dict[str, str] | None = None) -> str:
        out = subprocess.run(list(argv), capture_output=True, text=True, timeout=60,
                             env={**os.environ, **self.env, **(env or {})})
        if check and out.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: {out.stderr.strip()}")
        return out.stdout

    def submit(self, wrap: str, *, gres: str | None = None, comment: str | None = None, requeue: bool = True,
               account: str | None = None, name: str = "t", time_limit: str | None = None,
               env: dict[str, str] | None = None, cwd: Path | None = None) -> int:
        argv = ["sbatch", "--parsable", f"--job-name={name}", "--requeue" if requeue else "--no-requeue"]
        argv += [f"--gres={gres}"] if gres else []
        argv += [f"--comment={comment}"] if comment else []
        argv += [f"--account={account}"] if account else []
        argv += [f"--time={time_limit}"] if time_limit else []
        argv += [f"--output={(cwd or self.dir)}/slurm-%j.out", "--wrap", wrap]
        return int(self.run(*argv, env=env).strip().split(";")[0])

    def jobs(self) -> dict[int, dict]:
        return {j["job_id"]: j for j in json.loads(self.run("squeue", "--json"))["jobs"]}

    def job(self, job_id: int) -> dict | None:
        return self.jobs().get(job_id)

    def wait(self, predicate: Callable[[], object], timeout: float = 60.0, every: float = 0.3) -> object:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(every)
        raise AssertionError(f"timed out after {timeout} s waiting for {predicate}; squeue: "
                             f"{[(j['job_id'], j['job_state'], j['state_reason']) for j in self.jobs().values()]}")

    def wait_running(self, *job_ids: int, timeout: float = 60.0) -> None:
        self.wait(lambda: all((self.job(j) or {}).get("job_state") == "RUNNING" for j in job_ids), timeout)

    def cancel_all(self) -> None:
        """Cancel every job and wait until the node has let go of them (the next test starts on an empty node)."""
        ids = [str(j) for j, job in self.jobs().items() if job["job_state"] in ("RUNNING", "PENDING", "COMPLETING",
                                                                                  "SUSPENDED", "CONFIGURING")]
        if ids:
            self.run("scancel", *ids, check=False)
        self.wait(lambda: not any(job["job_state"] in ("RUNNING", "PENDING", "COMPLETING", "CONFIGURING")
                                  for job in self.jobs().values()), timeout=60)


def job_processes(job_id: int) -> list[psutil.Process]:
    """The live processes whose environment says they belong to Slurm job `job_id` (never two copies of a job)."""
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get("SLURM_JOB_ID") == str(job_id) and "collector.examples.train" in \
                    " ".join(proc.cmdline()):
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


def train_command(steps: int = 100_000, idle_s: float = 0.05, mode: str = "idle-holder") -> str:
    """A batch script line that runs the real torch training job on the SDK as the batch step's own process (exec),
    so `scancel --batch --signal=USR1` reaches the SDK."""
    return (f"exec {sys.executable} -m collector.examples.train --mode {mode} --steps {steps} --hold-mb 1 "
            f"--idle-s {idle_s}")


def drive_to_end(actuator: SlurmActuator, action_id: int, *, timeout_s: float, every_s: float = 0.5) -> str:
    """Advance one action with this actuator (its own options) until it ends or the time is up; its last state.
    What the cycle and `fleetlens drive` use is enforcer.actuators.drive.drive_actions."""
    deadline = time.monotonic() + timeout_s
    while True:
        actuator.advance(action_id, now=time.time())
        state = actuator.state(action_id)
        if state in TERMINAL or time.monotonic() > deadline:
            return state
        time.sleep(every_s)
