"""Consolidation through Slurm on a real one-node Slurm 22.05 (../shared/slurm/local-cluster.sh: 4 fake GPUs, 2 shards
each): how many GPUs the Slurm actuator frees, that it loses no job, touches no job that did not opt in and resumes
none below its checkpoint, and what a move costs next to a bare `scontrol requeue` of the same job.

The case: two idle training jobs that opted in (`--comment=fleetlens:movable`, real torch jobs on the SDK, mostly
sleeping) on shard:2 each, one busy job that opted in on shard:2, and one idle job that did not opt in on shard:2
(a batch script that records every signal it gets). A real agent (cpu source, as no GPU is here) samples the jobs'
processes; each cycle imports Slurm's view, plans from the samples and advances the actuator's moves, until nothing
more moves. Then each moved job is requeued once with a bare `scontrol requeue` (the anchor: Slurm's own requeue,
timed to the same end, the job's SDK saying it started again).

Prints one JSON line: gpus_freed, jobs_lost, not_opted_in_touched, resumed_below_checkpoint, two_copies,
move_s_median, requeue_s_median.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402
from sqlalchemy import select  # noqa: E402

from collector.importers.slurm import import_slurm  # noqa: E402
from enforcer.actuators.drive import drive_actions  # noqa: E402
from enforcer.actuators.slurm import TERMINAL, SlurmActuator  # noqa: E402
from enforcer.slurm_cycle import run_slurm_cycle  # noqa: E402
from store.db import Store  # noqa: E402
from store.migrations import upgrade  # noqa: E402
from store.models import Action, ActionEvent  # noqa: E402
from store.settings import Settings  # noqa: E402
from store.slurm import held_indices  # noqa: E402
from store.slurm_marks import job_folder, read_started  # noqa: E402

SCRIPT = ROOT.parent / "shared" / "slurm" / "local-cluster.sh"
if not SCRIPT.exists():
    SCRIPT = Path("/work/shared/slurm/local-cluster.sh")
MARK = "export FLEETLENS_WORKFLOW=slurm-$SLURM_JOB_ID; "  # the cpu source samples marked processes only
TRAIN = f"exec {sys.executable} -m collector.examples.train --steps 1000000 --threads 1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Bench:
    def __init__(self, work: Path) -> None:
        self.work = work
        self.home = work / "home"
        self.marks = work / "signals"
        self.marks.mkdir(parents=True)
        self.env: dict[str, str] = {"SLURM_LOCAL_CTLD_PORT": str(free_port()),
                                    "SLURM_LOCAL_SLURMD_PORT": str(free_port()), "SLURM_LOCAL_CRED_EXPIRE": "5"}
        self.agent: subprocess.Popen[bytes] | None = None

    def run(self, *argv: str, env: dict[str, str] | None = None) -> str:
        out = subprocess.run(list(argv), capture_output=True, text=True, timeout=120,
                             env={**os.environ, **self.env, **(env or {})})
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: {out.stderr.strip()[-500:]}")
        return out.stdout

    def start_cluster(self) -> None:
        for line in self.run(str(SCRIPT), "start", str(self.work / "cluster")).splitlines():
            if line.startswith("export "):
                key, _, value = line[len("export "):].partition("=")
                self.env[key] = value.strip("'\"")
        os.environ["SLURM_CONF"] = self.env["SLURM_CONF"]

    def stop_cluster(self) -> None:
        subprocess.run([str(SCRIPT), "stop", str(self.work / "cluster")], capture_output=True, timeout=120,
                       env={**os.environ, **self.env})

    def job_env(self) -> dict[str, str]:
        return {"PYTHONPATH": str(ROOT), "FLEETLENS_HOME": str(self.home), "FLEETLENS_SECRET": "bench"}

    def submit(self, wrap: str, *, name: str, comment: str | None = None) -> int:
        argv = ["sbatch", "--parsable", f"--job-name={name}", "--requeue", "--gres=shard:2",
                f"--output={self.work}/slurm-%j.out", "--wrap", wrap]
        if comment:
            argv.insert(2, f"--comment={comment}")
        return int(self.run(*argv, env=self.job_env()).strip().split(";")[0])

    def jobs(self) -> dict[int, dict[str, Any]]:
        return {j["job_id"]: j for j in json.loads(self.run("squeue", "--json"))["jobs"]}

    def wait(self, predicate: Any, timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if value := predicate():
                return value
            time.sleep(0.3)
        raise RuntimeError(f"timed out after {timeout} s waiting for {what}")

    def start_agent(self) -> None:
        env = {**os.environ, **self.job_env(), "FLEETLENS_CPU_TOP_PROCESSES": "0"}
        self.agent = subprocess.Popen(
            [sys.executable, "-c", "from ui.cli import main; main()", "agent", "--source", "cpu", "--host-id",
             "bench-agent", "--interval", "1", "--flush-interval", "1", "--no-socket"],
            env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop_agent(self) -> None:
        if self.agent is not None and self.agent.poll() is None:
            self.agent.terminate()
            try:
                self.agent.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.agent.kill()


def job_copies(job_id: int) -> int:
    n = 0
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get("SLURM_JOB_ID") == str(job_id) and "collector.examples.train" in \
                    " ".join(proc.cmdline()):
                n += 1
        except (psutil.Error, OSError):
            continue
    return n


def gpus_in_use(jobs: dict[int, dict[str, Any]]) -> set[int]:
    return {i for j in jobs.values() if j["job_state"] == "RUNNING" for i in held_indices(j["gres_detail"])}


def main() -> int:
    if shutil.which("slurmctld") is None:
        print(json.dumps({"error": "Slurm is not installed (make slurm)"}))
        return 2
    work = Path(tempfile.mkdtemp(prefix="fl-slurm-bench-"))
    bench = Bench(work)
    try:
        return measure(bench)
    finally:
        try:
            ids = [str(j) for j in bench.jobs()]
            if ids:
                subprocess.run(["scancel", *ids], capture_output=True, env={**os.environ, **bench.env})
        except Exception:  # the cluster may be the thing that failed; stop it all the same
            pass
        bench.stop_agent()
        bench.stop_cluster()
        shutil.rmtree(work, ignore_errors=True)


def measure(bench: Bench) -> int:
    bench.start_cluster()
    settings = Settings(home=bench.home, secret="bench", slurm=True, enforce=True, slurm_usage_window_s=8.0,
                        slurm_checkpoint_timeout_s=60, slurm_resume_timeout_s=90, max_moves_per_cycle=4)
    bench.home.mkdir(parents=True)
    store = Store(f"sqlite:///{bench.home / 'fleetlens.db'}")
    upgrade(store)
    os.environ["FLEETLENS_HOME"] = str(bench.home)  # the agent's store is this one
    trap = f"trap 'echo USR1 >> {bench.marks}/$SLURM_JOB_ID' USR1; while true; do sleep 0.2; done"
    idle = [bench.submit(MARK + TRAIN + " --mode idle-holder --hold-mb 1 --idle-s 0.5", name=f"idle{i}",
                         comment="fleetlens:movable") for i in range(2)]
    busy = bench.submit(MARK + TRAIN + " --mode healthy", name="busy", comment="fleetlens:movable")
    other = bench.submit(MARK + trap, name="not-opted-in")
    everyone = [*idle, busy, other]
    bench.wait(lambda: all(bench.jobs()[j]["job_state"] == "RUNNING" for j in everyone), 60, "the jobs to run")
    before = bench.jobs()
    gpus_before = gpus_in_use(before)
    bench.start_agent()
    # the jobs' start-up (importing torch) is busy work: plan on a window after it, once the agent has seen each
    # job's memory in enough samples for admission to let it share a GPU
    bench.wait(lambda: all(read_started(job_folder(settings, f"slurm-{j}")) for j in (*idle, busy)), 90,
               "the jobs' SDK to start")
    time.sleep(max(settings.slurm_usage_window_s, settings.memory_seen_steps * 1.0) + 3)
    actuator = SlurmActuator(store, settings)
    quiet, cycles, version = 0, 0, None
    while quiet < 5 and cycles < 400:
        cycles += 1
        version = import_slurm(store, settings).version
        result = run_slurm_cycle(store, settings, apply=True, now=time.time(), actuator=actuator)
        drive_actions(store, settings)  # one step of each move, as the enforcement cycle takes it
        with store.session() as s:
            open_moves = s.scalars(select(Action.id).where(Action.engine == "slurm",
                                                           Action.state.not_in(TERMINAL))).all()
        quiet = quiet + 1 if not open_moves and not result["begun"] else 0
        time.sleep(1.0)
    after = bench.jobs()
    with store.session() as s:
        actions = s.scalars(select(Action).where(Action.engine == "slurm")).all()
        moves = []
        for a in actions:
            end = s.scalar(select(ActionEvent.ts).where(ActionEvent.action_id == a.id, ActionEvent.to_state == a.state)
                           .order_by(ActionEvent.id.desc()).limit(1))
            moves.append({"job": a.detail["job_id"], "state": a.state, "seconds": end - a.created_at,
                          "checkpoint_step": a.checkpoint_step, "error": a.error})
    resumed = [m for m in moves if m["state"] == "resumed"]
    below = 0
    for m in resumed:
        started = read_started(job_folder(settings, f"slurm-{m['job']}"))
        below += started is None or started.step < (m["checkpoint_step"] or 0)
    gpus_after = gpus_in_use(after)
    # the anchor: a bare requeue of each moved job, timed to its SDK saying it started again
    requeue_s = []
    for m in resumed:
        job, folder = m["job"], job_folder(settings, f"slurm-{m['job']}")
        count = read_started(folder).restart_count
        t0 = time.time()
        bench.run("scontrol", "requeue", str(job))
        bench.wait(lambda folder=folder, count=count: (s := read_started(folder)) and s.restart_count > count, 120,
                   f"job {job} to start again after a bare requeue")
        requeue_s.append(time.time() - t0)
    final = bench.jobs()
    jobs_lost = sum(final.get(j, {}).get("job_state") not in ("RUNNING", "PENDING") for j in everyone)
    o = final[other]
    touched = int(o["restart_cnt"] != before[other]["restart_cnt"] or o["tres_per_node"] != "gres:shard:2"
                  or (bench.marks / str(other)).exists())
    line = {
        "benchmark": "slurm_consolidate", "slurm": version,
        "jobs": {"idle_opted_in": len(idle), "busy_opted_in": 1, "not_opted_in": 1}, "cycles": cycles,
        "gpus_before": len(gpus_before), "gpus_after": len(gpus_after),
        "gpus_freed": len(gpus_before) - len(gpus_after),
        "moves": len(moves), "resumed": len(resumed), "jobs_lost": jobs_lost, "not_opted_in_touched": touched,
        "resumed_below_checkpoint": below, "two_copies": sum(job_copies(j) > 1 for j in everyone),
        "move_s_median": round(statistics.median(m["seconds"] for m in resumed), 2) if resumed else None,
        "requeue_s_median": round(statistics.median(requeue_s), 2) if requeue_s else None,
        "moved": sorted(m["job"] for m in resumed), "busy_moved": busy in {m["job"] for m in moves},
        "failed": [m["error"] for m in moves if m["state"] != "resumed"],
    }
    print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
