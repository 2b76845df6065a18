"""Migration downtime of a job with 100 MB of state on the CPU, and where it goes: checkpoint, stopping, process
start, restore, and fleetlens's own orchestration (signed commands, agent polling, the store).

The case: a real agent (cpu source) runs a managed job (this file with --job: 100 MiB of float32 state in torch,
checkpointed with torch.save + fsync on request, restored on resume); the enforcer moves it between the two cpu
devices with the migration state machine. Downtime = first step of the new process - start of the checkpoint in
the old one (training does not advance in between: the steps the old process ran after its checkpoint are lost).
The anchor, same job, same run: the bare cycle with no fleetlens in the loop (the job saves at a step and exits,
a new process resumes from the file at once) — the floor any checkpoint-based move pays.

Prints one JSON line (medians over REPEATS moves): downtime and its shares for both, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STATE_BYTES = 100 * 2**20
REPEATS = 2


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


# ---- the job ------------------------------------------------------------------------------------------------------

def job_main(steps: int, save_at: int | None, ckpt_dir: str | None) -> int:
    import psutil

    t_exec = psutil.Process().create_time()
    import torch

    from collector.job import job

    t_imported = time.time()
    torch.set_num_threads(1)
    state = torch.zeros(STATE_BYTES // 4, dtype=torch.float32)

    def save(directory: str) -> str:
        t0 = time.time()
        folder = Path(directory)
        folder.mkdir(parents=True, exist_ok=True)
        final = folder / f"state-{j.step:09d}.pt"
        tmp = folder / f".{final.name}.tmp"
        with open(tmp, "wb") as f:
            torch.save({"state": state, "step": j.step}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        emit("checkpoint", t_start=t0, save_s=time.time() - t0, step=j.step, bytes=final.stat().st_size)
        return str(final)

    def restore(path: str) -> int:
        t0 = time.time()
        saved = torch.load(path, map_location="cpu", weights_only=True)
        state.copy_(saved["state"])
        emit("restored", t_start=t0, restore_s=time.time() - t0)
        return int(saved["step"])

    with job("migration-bench", total_steps=steps, checkpoint=save, restore=restore) as j:
        if j.start_step == 0:
            state.normal_()  # real values to save (a fresh run only; a resumed one gets them from the file)
        first = True
        for step in j.steps():
            if first:
                emit("first_step", t=time.time(), step=step, t_exec=t_exec, t_imported=t_imported)
                first = False
            state[: 1 << 16].add_(1.0)  # a little work per step
            time.sleep(0.01)
            if save_at is not None and step + 1 == save_at:
                save(ckpt_dir or ".")
                emit("exit", t=time.time())
                return 0
    emit("done", t=time.time(), step=j.step)
    return 0


def read_events(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def breakdown(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> dict[str, float]:
    """Downtime and its parts from the two processes' events (wall-clock seconds)."""
    ckpt = [e for e in old if e["event"] == "checkpoint"][-1]
    restored = next(e for e in new if e["event"] == "restored")
    first = next(e for e in new if e["event"] == "first_step")
    downtime = first["t"] - ckpt["t_start"]
    parts = {
        "checkpoint_s": ckpt["save_s"],
        "process_start_s": first["t_imported"] - first["t_exec"],  # exec, Python and torch import
        "restore_s": restored["restore_s"],
    }
    parts["other_s"] = downtime - sum(parts.values())  # stopping, waiting, signed commands, the store
    return {"downtime_s": downtime, **parts}


# ---- the anchor: the bare cycle -------------------------------------------------------------------------------------

def bare_cycle(work: Path, i: int) -> dict[str, float]:
    folder = work / f"bare-{i}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FLEETLENS_HOME": str(work / "bare-home"),
           "FLEETLENS_WORKFLOW": f"bare-{i}", "FLEETLENS_SDK_RETRY_S": "3600"}
    me = [sys.executable, str(Path(__file__).resolve()), "--job", "--steps", "200"]
    first = subprocess.run([*me, "--save-at", "20", "--checkpoint-dir", str(folder)], env=env, capture_output=True,
                           text=True, check=True)
    old = [json.loads(line) for line in first.stdout.splitlines() if line.startswith("{")]
    path = next(e for e in old if e["event"] == "checkpoint")
    saved = sorted(folder.glob("state-*.pt"))[-1]
    second = subprocess.run([*me, "--save-at", str(path["step"] + 1), "--checkpoint-dir", str(work / "discard")],
                            env={**env, "FLEETLENS_RESUME_FROM": str(saved)}, capture_output=True, text=True,
                            check=True)
    new = [json.loads(line) for line in second.stdout.splitlines() if line.startswith("{")]
    return breakdown(old, new)


# ---- fleetlens: a real migration ----------------------------------------------------------------------------------

def fleetlens_moves(work: Path) -> list[dict[str, float]]:
    from enforcer.actuators.drive import drive_actions
    from enforcer.migration import MigrationOptions, action_log, start_migration
    from store.db import Store
    from store.migrations import upgrade
    from store.models import Command
    from store.settings import Settings
    from tests.collector.agent_helpers import wait_for
    from tests.enforcer.migration_helpers import AgentProc
    from ui.serve.run import run_managed

    home = work / "home"
    settings = Settings(home=home, secret="bench-secret")
    settings.ensure_home()
    store = Store.from_settings(settings)
    upgrade(store)
    agent = AgentProc(home, FLEETLENS_SECRET="bench-secret", FLEETLENS_SAMPLE_INTERVAL_S="0.2",
                      FLEETLENS_FLUSH_INTERVAL_S="1")
    results = []
    try:
        agent.start(store)
        settings = settings.model_copy(update={"host_id": agent.host_id})
        devices = [d.id for d in agent.devices(store)]
        job, _ = run_managed(store, [sys.executable, str(Path(__file__).resolve()), "--job", "--steps", "100000"],
                             detach=True, settings=settings, movable=True, name="bench", cwd=ROOT)
        log = Path(job.log_path)
        options = MigrationOptions(checkpoint_timeout_s=60, command_grace_s=10)
        where = job.device_ids[0]
        for i in range(REPEATS):
            print(f"migration {i + 1}/{REPEATS} ...", file=sys.stderr)

            def started(n: int = i + 1) -> bool:
                return sum(1 for e in read_events(log) if e["event"] == "first_step") >= n

            wait_for(started, timeout=120, every=0.2)
            time.sleep(1.0)  # let it train a little first
            target = next(d for d in devices if d != where)
            action_id = start_migration(store, job.workflow_id, target, settings=settings)
            states = drive_actions(store, action_ids=[action_id], settings=settings,
                                   migration_options=options, timeout_s=120,
                                      poll_s=0.05)
            if states.get(action_id) != "resumed":
                raise SystemExit(f"migration {i + 1} ended {states}: {action_log(store, action_id)}")
            wait_for(lambda n=i + 2: started(n), timeout=60)
            events = read_events(log)
            last = max(k for k, e in enumerate(events) if e["event"] == "first_step")
            result = breakdown(events[:last], events[last - 1:])
            with store.session() as s:
                cmds = {c.kind: c for c in s.query(Command).filter(Command.action_id == action_id)}
                result["agent_relaunch_s"] = cmds["relaunch"].done_at - cmds["relaunch"].claimed_at
            results.append(result)
            where = target
    finally:
        agent.stop()
        import psutil

        for proc in psutil.process_iter():
            try:
                if proc.environ().get("FLEETLENS_MANAGED") == agent.host_id:
                    proc.kill()
            except psutil.Error:
                continue
        store.dispose()
    return results


def median_of(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: round(statistics.median(r[k] for r in rows), 4) for k in rows[0]}


def shares(row: dict[str, float]) -> dict[str, float]:
    return {k[:-2] + "_share": round(row[k] / row["downtime_s"], 3)
            for k in ("checkpoint_s", "process_start_s", "restore_s", "other_s")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--job", action="store_true", help="run as the benchmark's training job")
    ap.add_argument("--steps", type=int, default=100000)
    ap.add_argument("--save-at", type=int, default=None)
    ap.add_argument("--checkpoint-dir", default=None)
    args = ap.parse_args()
    if args.job:
        sys.exit(job_main(args.steps, args.save_at, args.checkpoint_dir))
    work = Path(tempfile.mkdtemp(prefix="fleetlens-migration-bench-"))
    print(f"bare checkpoint/restart cycles (anchor) in {work} ...", file=sys.stderr)
    bare = [bare_cycle(work, i) for i in range(REPEATS)]
    moves = fleetlens_moves(work)
    fl, anchor = median_of(moves), median_of(bare)
    print(json.dumps({
        "benchmark": "migration", "state_bytes": STATE_BYTES, "moves": len(moves),
        "fleetlens": {**fl, **shares(fl)}, "bare_cycle": {**anchor, **shares(anchor)},
        "ratio_downtime_to_bare": round(fl["downtime_s"] / anchor["downtime_s"], 3),
    }))


if __name__ == "__main__":
    main()
