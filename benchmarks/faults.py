"""The fault matrix: real moves of a real torch job from host A to host B (two agents on this machine, each with its
own host id and FLEETLENS_HOME, one PostgreSQL, a shared checkpoint folder), with one fault injected when the move
reaches each state: the job killed, the source agent killed, the target agent killed, the database stopped, the
checkpoint location unreadable on the target.

How the faults are made: agents and jobs are killed with SIGKILL (a killed agent is started again 3 s later, as a
supervisor would); "the database stopped" cuts every connection of the agents and the enforcer to PostgreSQL at a
TCP proxy between them and the server for 6 s (the server itself is shared with other work on this machine); "the
checkpoint location unreadable on the target" restarts host B's agent in its own mount namespace with an empty
tmpfs over the shared folder, so B and what B starts cannot see it (B gets the folder back after the move ends).

Each job saves a checkpoint every CHECKPOINT_EVERY steps besides the ones the moves ask for. After each case the
job must finish its full step count, by its own summary line (jobs_lost counts those that did not);
steps_redone_max is the most steps any case reported twice (at most the checkpoint interval); processes_left counts
the processes the benchmark started (agents and jobs, found by a FLEETLENS_HOME inside its work folder, never by
command line) still alive 10 s after the agents were stopped, each named under "left"; stray_job_copies counts
processes of a case's job still alive 10 s after the job finished (named per case), and unsafe_moves_accepted counts
moves recorded as resumed whose new process started below the checkpoint step. The PostgreSQL server is never
stopped: only this benchmark's connections through its own proxy are cut.

Prints one JSON line: {"case": "fault_matrix", "moves", "faults", "jobs_lost", "steps_redone_max",
"processes_left", "unsafe_moves_accepted", ...}. `--states` / `--faults` run part of the matrix.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STATES = ("checkpoint_requested", "checkpointed", "stopped", "relaunched")
FAULTS = ("job_killed", "source_agent_killed", "target_agent_killed", "database_stopped",
          "checkpoint_unreadable_on_target")
TOTAL_STEPS = 300
CHECKPOINT_EVERY = 50
PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
AGENT_START_S = 300.0  # a loaded machine starts Python and torch slowly


class Matrix:
    def __init__(self, work: Path, pg_url: str) -> None:
        import psutil
        from sqlalchemy import text

        from store.db import Store
        from store.migrations import upgrade
        from store.settings import Settings
        from tests.collector.agent_helpers import TcpProxy
        from tests.enforcer.migration_helpers import AgentProc

        self.psutil = psutil
        self.work = work
        self.schema = f"fl_faults_{uuid.uuid4().hex[:8]}"
        self.admin = Store(pg_url)
        with self.admin.engine.begin() as conn:
            conn.execute(text(f"CREATE SCHEMA {self.schema}"))
        direct = f"{pg_url}?options=-csearch_path%3D{self.schema}"
        self.direct = Store(direct)
        upgrade(self.direct)
        self.proxy = TcpProxy("127.0.0.1", int(self.direct.url.port or 5432)).start()
        self.url = self.proxy.url(direct)
        self.store = Store(self.url, connect_timeout_s=2)
        self.shared = work / "shared"
        self.shared.mkdir()
        env = {"FLEETLENS_SECRET": "faults-secret", "FLEETLENS_STORAGE_PROBE_S": "1"}
        self.a = AgentProc(work / "host-a", db_url=self.url, **env)
        self.b = AgentProc(work / "host-b", db_url=self.url, **env)
        try:
            self.a.start(self.direct, timeout=AGENT_START_S)
            self.b.start(self.direct, timeout=AGENT_START_S)
        except BaseException:  # an agent that did start must not outlive a set-up that failed
            self.a.stop()
            self.b.stop()
            raise
        self.settings = Settings(home=self.a.home, secret="faults-secret", host_id=self.a.host_id, db_url=self.url,
                                 checkpoint_url=str(self.shared))
        self.AgentProc = AgentProc
        self.db_cut = False
        # one restart at a time: a restart still starting its agent when the next one began used to leave one of
        # the two new agents unknown to the benchmark, running on with the same host id (never stopped)
        self.restarting = threading.Lock()

    # ---- faults
    def restart(self, which: str, hide: bool = False) -> None:
        with self.restarting:
            old = getattr(self, which)
            old.kill()
            time.sleep(3)
            new = self.AgentProc(old.home, host_id=old.host_id, db_url=self.url, hide=self.shared if hide else None,
                                 FLEETLENS_SECRET="faults-secret", FLEETLENS_STORAGE_PROBE_S="1")
            setattr(self, which, new)  # known before it starts: stopped at the end even if its start fails
            new.start(self.direct, timeout=AGENT_START_S)

    def kill_job(self, workflow_id: str) -> None:
        for proc in self.jobs(workflow_id):
            proc.kill()

    def jobs(self, workflow_id: str | None = None) -> list[Any]:
        found = []
        for proc in self.psutil.process_iter():
            try:
                env = proc.environ()
            except self.psutil.Error:
                continue
            if env.get("FLEETLENS_MANAGED") in (self.a.host_id, self.b.host_id) and (
                    workflow_id is None or env.get("FLEETLENS_WORKFLOW") == workflow_id):
                found.append(proc)
        return found

    def inject(self, fault: str, workflow_id: str) -> threading.Thread | None:
        if fault == "job_killed":
            self.kill_job(workflow_id)
        elif fault == "source_agent_killed":
            return _background(lambda: self.restart("a"))
        elif fault == "target_agent_killed":
            return _background(lambda: self.restart("b"))
        elif fault == "database_stopped":
            self.proxy.cut()
            self.db_cut = True
            return _background(self.restore_db)
        elif fault == "checkpoint_unreadable_on_target":
            return _background(lambda: self.restart("b", hide=True))
        return None

    def restore_db(self) -> None:
        time.sleep(6)
        self.proxy.restore()
        self.db_cut = False

    # ---- one case
    def case(self, state: str, fault: str) -> dict[str, Any]:
        from enforcer.actuators.drive import drive_actions
        from enforcer.migration import MigrationOptions, drive, start_migration
        from store.paths import path_component
        from tests.collector.agent_helpers import wait_for
        from tests.enforcer.migration_helpers import last_step, train_cmd
        from ui.serve.run import run_managed

        workflow_id = f"fault-{state}-{fault}-{uuid.uuid4().hex[:4]}"
        folder = self.shared / path_component(workflow_id)
        command = train_cmd(TOTAL_STEPS, "--save-every", str(CHECKPOINT_EVERY), "--checkpoint-dir", str(folder),
                            step_sleep=0.05)
        run_managed(self.direct, command, detach=True, settings=self.settings, movable=True, cwd=ROOT,
                    workflow_id=workflow_id, steps=TOTAL_STEPS, mem_bytes=64 << 20)
        wait_for(lambda: last_step(self.direct, workflow_id) >= 30, timeout=180, every=0.5)
        wait_for(lambda: self.b_reads(workflow_id), timeout=60, every=0.5)
        options = MigrationOptions(checkpoint_timeout_s=30, command_grace_s=5, resume_timeout_s=60,
                                   checkpoint_max_age_s=2.0)
        target = self.b.devices(self.direct)[0].id
        action_id = start_migration(self.direct, workflow_id, target, settings=self.settings)
        reached = False
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            now = drive(self.direct, action_id, settings=self.settings, options=options)
            if now == state:
                reached = True
                break
            if now in ("resumed", "rolled_back", "failed"):
                break
            time.sleep(0.05)
        helper = self.inject(fault, workflow_id) if reached else None
        states = drive_actions(self.store, action_ids=[action_id], settings=self.settings,
                               migration_options=options, timeout_s=300)
        if helper is not None:
            helper.join()  # the restarted agent is up (or failed to start) before anything else happens
        if fault == "checkpoint_unreadable_on_target":
            self.restart("b")  # B sees the shared folder again
        finished = _wait(lambda: self.workflow_state(workflow_id) == "finished", 300)
        # a job that has just printed its summary may still be exiting: what lives 10 s later is a stray copy
        strays = _still_alive(self.jobs(workflow_id), 10) if finished else []
        return {"state": state, "fault": fault, "reached": reached, "final": states.get(action_id),
                "finished": finished, "strays": [_describe(p) for p in strays], **self.judge(workflow_id, action_id)}

    def b_reads(self, workflow_id: str) -> bool:
        from store.models import HostStorage, Workflow

        with self.direct.session() as s:
            url = s.get(Workflow, workflow_id).checkpoint_url
            row = s.get(HostStorage, (self.b.host_id, url))
            return row is not None and row.readable

    def workflow_state(self, workflow_id: str) -> str | None:
        from store.models import Workflow

        with self.direct.session() as s:
            wf = s.get(Workflow, workflow_id)
            return None if wf is None else wf.state

    def judge(self, workflow_id: str, action_id: int) -> dict[str, Any]:
        from sqlalchemy import select

        from store.models import Action, Command, StepStat

        with self.direct.session() as s:
            rows = list(s.scalars(select(StepStat).where(StepStat.workflow_id == workflow_id)))
            action = s.get(Action, action_id)
            relaunches = list(s.scalars(select(Command).where(Command.action_id == action_id,
                                                              Command.kind == "relaunch")))
            counts: Counter[int] = Counter()
            for r in rows:
                counts.update(range(r.first_step, r.last_step + 1))
            missing = [i for i in range(TOTAL_STEPS) if counts[i] == 0]
            unsafe = 0
            if action.state == "resumed":
                moved = [c for c in relaunches if c.status == "done" and (c.payload or {}).get("purpose") == "move"]
                pid = int(moved[-1].result["pid"]) if moved else None
                firsts = [r.first_step for r in rows if r.pid == pid]
                if action.checkpoint_step is not None and firsts and min(firsts) < action.checkpoint_step:
                    unsafe += 1
            return {"end_step": self.end_step(workflow_id), "missing_step_reports": len(missing),
                    "steps_redone": sum(1 for c in counts.values() if c > 1), "unsafe": unsafe,
                    "action_state": action.state}

    def end_step(self, workflow_id: str) -> int | None:
        """The step the job's finished run ended at, from its own summary line (the job's word, not the SDK's step
        reports, which a job drops while its agent is down)."""
        from store.paths import path_component

        ends = []
        for agent in (self.a, self.b):
            log = agent.home / "logs" / f"{path_component(workflow_id)}.log"
            if log.exists():
                for line in log.read_text(errors="replace").splitlines():
                    if line.startswith("{") and '"event": "done"' in line:
                        ends.append(int(json.loads(line)["end_step"]))
        return max(ends, default=None)

    def close(self) -> list[dict[str, Any]]:
        """Stop the agents and clean up; returns every process still alive that the benchmark started (agents and
        jobs, found by a FLEETLENS_HOME inside its work folder), described, after killing them."""
        from sqlalchemy import text

        from tests.procs import processes_under

        if self.db_cut:
            self.proxy.restore()
        self.a.stop()
        self.b.stop()
        # a job that has just printed its summary may still be exiting: what is alive 10 s later was left behind
        left = _still_alive(processes_under(self.work), 10)
        described = [_describe(p) for p in left]
        for proc in left:
            try:
                proc.kill()
            except self.psutil.Error:
                continue
        self.store.dispose()
        self.direct.dispose()
        with self.admin.engine.begin() as conn:
            conn.execute(text(f"DROP SCHEMA {self.schema} CASCADE"))
        self.admin.dispose()
        self.proxy.cut()
        return described


def _still_alive(procs: list[Any], timeout: float) -> list[Any]:
    import psutil

    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return [p for p in alive if _running(p)]


def _running(proc: Any) -> bool:
    import psutil

    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _describe(proc: Any) -> dict[str, Any]:
    """What a left-over process is: whose (host, workflow), started when, by whom, doing what."""
    import psutil

    try:
        env = proc.environ()
        return {"pid": proc.pid, "ppid": proc.ppid(), "status": proc.status(),
                "age_s": round(time.time() - proc.create_time(), 1), "host": env.get("FLEETLENS_HOST_ID"),
                "managed_by": env.get("FLEETLENS_MANAGED"), "workflow": env.get("FLEETLENS_WORKFLOW"),
                "cmdline": " ".join(proc.cmdline())[:200]}
    except psutil.Error as exc:
        return {"pid": proc.pid, "gone": str(exc)}


def _background(fn: Any) -> threading.Thread:
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


def _wait(predicate: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.5)
    return False


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pg-url", default=PG_URL)
    ap.add_argument("--states", default=",".join(STATES))
    ap.add_argument("--faults", default=",".join(FAULTS))
    args = ap.parse_args()
    states = [s for s in args.states.split(",") if s]
    faults = [f for f in args.faults.split(",") if f]
    for name in [*states, *faults]:
        if name not in STATES + FAULTS:
            raise SystemExit(f"unknown state or fault {name!r}; states: {', '.join(STATES)}; faults: "
                             f"{', '.join(FAULTS)}")
    work = Path(tempfile.mkdtemp(prefix="fleetlens-faults-"))
    matrix = Matrix(work, args.pg_url)
    cases = []
    left: list[dict[str, Any]] = []
    started = time.monotonic()
    try:
        for state in states:
            for fault in faults:
                print(f"{state} x {fault} ...", file=sys.stderr, flush=True)
                result = matrix.case(state, fault)
                print(json.dumps({"event": "case", **result}), file=sys.stderr, flush=True)
                cases.append(result)
    finally:
        left = matrix.close()
    injected = [c for c in cases if c["reached"]]
    print(json.dumps({
        "case": "fault_matrix", "moves": len(cases), "faults": len(injected),
        "jobs_lost": sum(1 for c in cases if not c["finished"] or c["end_step"] != TOTAL_STEPS),
        "steps_redone_max": max((c["steps_redone"] for c in cases), default=0),
        "processes_left": len(left), "unsafe_moves_accepted": sum(c["unsafe"] for c in cases),
        "checkpoint_interval": CHECKPOINT_EVERY,
        "outcomes": dict(Counter(f"{c['state']}/{c['fault']}:{c['final']}" for c in cases)),
        "stray_job_copies": sum(len(c["strays"]) for c in cases), "left": left,
        "run_s": round(time.monotonic() - started, 1), "load_average": list(os.getloadavg()),
    }))


if __name__ == "__main__":
    main()
