"""A move between two hosts driven through the real migration state machine on a fake clock, with the hosts' agents
played by the test: each agent heartbeats (Host.last_seen) and answers its commands (a checkpoint recorded, the job
stopped, the job started) the way collector.job_control and collector.job_start do, until it falls silent at a
time the test chooses; a silent agent neither heartbeats nor answers, and a command it had claimed stays 'running'.

The job's process is tracked as the agents' answers leave it (where it runs, and for how long it ran nowhere), so a
test can say whether a move lost time or ran the job twice."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import select, update

from enforcer.migration import action_log, drive, start_migration
from store.checkpoints import record_checkpoint, record_probes
from store.commands import claim_pending, finish
from store.db import Store
from store.models import Action, Command, Host, Placement, StepStat, Workflow
from store.registry import DeviceSpec, register_devices, register_host
from store.settings import Settings
from store.workflows import sign_workflow_spec, upsert_workflow

GIB = 2**30
T0 = 1_800_000_000.0  # when the move is begun
SRC, DST = "src", "dst"
JOB = "job"
SETTINGS = Settings(secret="test-secret", storage_probe_max_age_s=900.0)  # host_silence_s: 120 s


@dataclass
class SilentFleet:
    """`silent_at[host]`: when that host's agent last heartbeats and answers (None: never falls silent).
    `takes[kind]`: seconds an agent takes to answer a command of that kind after claiming it."""

    store: Store
    root: Path
    silent_at: dict[str, float | None] = field(default_factory=lambda: {SRC: None, DST: None})
    takes: dict[str, float] = field(default_factory=lambda: {"checkpoint": 5.0, "stop": 1.0, "relaunch": 2.0})
    devices: dict[str, int] = field(default_factory=dict)
    running_on: str | None = SRC  # where the job's process runs (None: nowhere)
    pid: int = 100
    copies: int = 1  # processes of the job alive at once (a move must never make it 2)
    most_copies: int = 1
    down_since: float | None = None
    downtime: float = 0.0
    claimed: dict[int, float] = field(default_factory=dict)  # command id -> when its agent claimed it
    action_id: int | None = None
    settings: Settings = field(default_factory=lambda: SETTINGS)

    def seed(self) -> SilentFleet:
        location = str(self.root / "shared")
        with self.store.session() as s:
            for host in (SRC, DST):
                heard = self.heard(host, T0)
                register_host(s, host, hostname=host, source="replay", now=heard)
                got = register_devices(s, host, [DeviceSpec(0, f"GPU-{host}", "T4", 16 * GIB)], source="replay",
                                       now=heard)
                self.devices[host] = got[0]
                record_probes(s, host, [(location, None)], now=heard)
            wf = upsert_workflow(s, JOB, now=T0 - 3600, managed=True, movable=True, command=["python", "train.py"],
                                 mem_persistent=GIB, mem_ephemeral=0, id_source="managed", state="running",
                                 checkpoint_url=location, checkpoint_dir=f"{location}/{JOB}")
            sign_workflow_spec(wf, SETTINGS.secret_bytes())
            s.add(Placement(workflow_id=JOB, device_id=self.devices[SRC], host_id=SRC, pid=self.pid,
                            mem_persistent=GIB, mem_ephemeral=0, state="active", started_at=T0 - 3600))
        return self

    def heard(self, host: str, now: float) -> float:
        """When `host` was last heard from at `now`."""
        silent = self.silent_at[host]
        return now if silent is None else min(now, silent)

    def begin(self) -> int:
        self.action_id = start_migration(self.store, JOB, self.devices[DST], settings=self.settings, now=T0)
        return self.action_id

    def tick(self, now: float) -> None:
        """The agents at `now`: heartbeat, claim what is pending, answer what they claimed long enough ago."""
        with self.store.session() as s:
            for host in (SRC, DST):
                alive = self.silent_at[host] is None or now <= self.silent_at[host]
                s.execute(update(Host).where(Host.id == host).values(last_seen=self.heard(host, now)))
                if not alive:
                    continue
                for command in claim_pending(s, host, now=now):
                    self.claimed[command.id] = now
                for command in s.scalars(select(Command).where(Command.host_id == host,
                                                               Command.status == "running")):
                    if now - self.claimed.get(command.id, now) >= self.takes.get(command.kind, 1.0):
                        self.answer(s, command, now)

    def answer(self, s, command: Command, now: float) -> None:
        payload = dict(command.payload or {})
        if now > command.expires_at:  # the agents refuse what expired (collector.commands)
            finish(s, command.id, "refused", {"reason": "expired"}, now=now)
            return
        if command.kind == "checkpoint":
            step = int((now - T0) * 10) + 1000
            fact = record_checkpoint(s, JOB, host_id=command.host_id, url=f"{payload['directory']}/step-{step}.pt",
                                     step=step, sha256="0" * 64, size_bytes=10, action_id=command.action_id, now=now)
            finish(s, command.id, "done", {"status": "done", "checkpoint_id": fact.id, "url": fact.url,
                                           "step": step, "size_bytes": 10, "sha256": "0" * 64}, now=now)
        elif command.kind == "stop":
            if self.running_on != command.host_id:
                finish(s, command.id, "done", {"already_stopped": True, "stopped": [], "killed": []}, now=now)
                return
            taken = payload.get("checkpoint_taken_at")
            if taken is not None and now - float(taken) > float(payload.get("max_age_s") or 0):
                finish(s, command.id, "done", {"stale_checkpoint": True, "age_s": round(now - float(taken), 1),
                                               "stopped": [], "killed": []}, now=now)
                return
            self.copies -= 1
            self.running_on, self.down_since = None, now
            finish(s, command.id, "done", {"stopped": [self.pid], "killed": []}, now=now)
        elif command.kind == "relaunch":
            self.pid += 1
            self.copies += 1
            self.most_copies = max(self.most_copies, self.copies)
            self.running_on = command.host_id
            if self.down_since is not None:
                self.downtime += now - self.down_since
                self.down_since = None
            finish(s, command.id, "done", {"pid": self.pid, "log": "job.log"}, now=now)
            action = s.get(Action, command.action_id)
            first = action.checkpoint_step if action is not None and action.checkpoint_step is not None else 0
            s.add(StepStat(workflow_id=JOB, host_id=command.host_id, pid=self.pid, ts_start=now + 1, ts_end=now + 2,
                           first_step=first, last_step=first + 9, n_steps=10, mean_s=0.1, p50_s=0.1, p95_s=0.1,
                           max_s=0.1))

    def run(self, until: float = 1200.0, every: float = 1.0, since: float = 0.0) -> tuple[str, float]:
        """Drive the move every `every` s (as drive_actions does, on the fake clock) from `since` s after T0 until it
        is over; returns its final state and when it got there (seconds after T0)."""
        assert self.action_id is not None
        now, state = T0 + since, "planned"
        while now <= T0 + until:
            self.tick(now)
            state = drive(self.store, self.action_id, settings=self.settings, now=now)
            if state in ("resumed", "rolled_back", "failed"):
                self.tick(now)
                return state, now - T0
            now += every
        return state, now - T0

    def job_down_for(self, now: float) -> float:
        """Seconds the job ran nowhere in all (up to `now`, if it runs nowhere still)."""
        return self.downtime + (now - self.down_since if self.down_since is not None else 0.0)

    def log(self) -> str:
        return " | ".join(e["message"] for e in action_log(self.store, self.action_id))

    def workflow_state(self) -> str:
        with self.store.session() as s:
            return s.get(Workflow, JOB).state

    def placement_host(self) -> str | None:
        with self.store.session() as s:
            row = s.scalar(select(Placement).where(Placement.workflow_id == JOB, Placement.state == "active"))
            return None if row is None else row.host_id

    def commands(self) -> list[tuple[str, str, str]]:
        with self.store.session() as s:
            return [(c.kind, c.host_id, c.status) for c in s.scalars(
                select(Command).where(Command.action_id == self.action_id).order_by(Command.id))]
