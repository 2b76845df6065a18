"""The steps of the agents' migration state machine (enforcer.migration drives it): what each state waits for, which
signed command it sends the job's host next (checkpoint, stop, relaunch), and when it rolls back or fails.

Each step reads the action and the commands issued for it from the store and takes at most one transition, so it is
idempotent: a command whose outcome never arrives is sent again after its deadline. Its own verification runs here:
the relaunch spec matches its signature (`planned`, and the agent again), the checkpoint is young enough when the stop
reaches the job (`checkpointed`, by the agent), and a relaunched job resumes at or above its checkpoint's step
(`relaunched`); the checkpoint's size and sha256 the agent that starts the job checks. The plan-level checks (target
capacity, storage readable from the target) ran once before any of this, when the move was begun
(enforcer.move_checks): no step repeats them. What a step does when a host it waits on has gone silent since is
enforcer.move_silence.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from enforcer.move_silence import fencing, halt_if_silent, roll_back_if_target_silent, unsettled
from store.checkpoints import latest_checkpoint
from store.commands import enqueue_command
from store.headroom import charged
from store.models import Action, ActionEvent, Checkpoint, Command, Device, Lane, Placement, StepStat, Workflow
from store.placements import MOVE_OVER, close_empty_lanes
from store.settings import Settings
from store.workflows import spec_refusal

log = logging.getLogger(__name__)

OUTSTANDING = ("pending", "running")


@dataclass(frozen=True)
class MigrationOptions:
    """Deadlines of the steps. A command with no outcome `command_grace_s` after its own deadline is taken as
    lost and sent again (at most `max_attempts` times per step)."""

    checkpoint_timeout_s: float = 120.0
    stop_grace_s: float = 10.0
    start_timeout_s: float = 3.0  # a relaunched job must survive this long (or say hello to its agent sooner)
    command_grace_s: float = 15.0
    resume_timeout_s: float = 120.0
    max_attempts: int = 3
    # a checkpoint older than this when the stop reaches the job (the store or an agent was away in between) is taken
    # again first, so a move redoes at most about this much training
    checkpoint_max_age_s: float = 10.0

    @classmethod
    def from_settings(cls, settings: Settings, **overrides: Any) -> MigrationOptions:
        return cls(**{"checkpoint_timeout_s": settings.checkpoint_timeout_s, **overrides})



def transition(session: Session, action: Action, state: str, message: str, now: float,
        detail: dict[str, Any] | None = None, **fields: Any) -> None:
    previous = action.state
    for key, value in fields.items():
        setattr(action, key, value)
    action.state, action.updated_at = state, now
    if state == "failed" and "error" not in fields:
        action.error = message
    session.add(ActionEvent(action_id=action.id, ts=now, from_state=previous, to_state=state, message=message,
                            detail=detail or {}))
    session.flush()
    if state in MOVE_OVER and action.to_lane_id is not None:
        # the move no longer holds its target lane: it closes if the job is not in it (rolled back, failed) and
        # nobody else is either
        close_empty_lanes(session, {action.to_lane_id}, now)
    log.info("action %s (%s): %s -> %s: %s", action.id, action.workflow_id, previous, state, message)


def note_event(session: Session, action: Action, message: str, now: float,
               detail: dict[str, Any] | None = None) -> None:
    """An event that changes no state (a command sent again, say)."""
    session.add(ActionEvent(action_id=action.id, ts=now, from_state=action.state, to_state=action.state,
                            message=message, detail=detail or {}))
    action.updated_at = now
    session.flush()


def active_placement(session: Session, workflow_id: str, device_id: int | None = None) -> Placement | None:
    query = select(Placement).where(Placement.workflow_id == workflow_id, Placement.state == "active")
    if device_id is not None:
        query = query.where(Placement.device_id == device_id)
    return session.scalar(query.order_by(Placement.id.desc()).limit(1))


def admitted_memory(wf: Workflow, placement: Placement | None) -> tuple[int, int]:
    """(P, E) of the job as measured: what its placement was admitted with, else what the workflow reports."""
    if placement is not None and placement.mem_persistent is not None:
        return int(placement.mem_persistent), int(placement.mem_ephemeral or 0)
    return int(wf.mem_persistent or 0), int(wf.mem_ephemeral or 0)


def admitted_profile(wf: Workflow, placement: Placement | None) -> tuple[int, int]:
    """(P', E) of the job as a lane admits it (the headroom applied by store.headroom)."""
    persistent, ephemeral = admitted_memory(wf, placement)
    return charged(persistent), ephemeral


class StepRunner:
    def __init__(self, session: Session, action: Action, settings: Settings, options: MigrationOptions,
                 now: float) -> None:
        self.session, self.action, self.settings, self.options, self.now = session, action, settings, options, now

    def run(self, fn: Any) -> None:
        wf = self.session.get(Workflow, self.action.workflow_id)
        if wf is None:
            self.fail(f"workflow {self.action.workflow_id!r} is no longer in the store; nothing more is done")
            return
        fn(self, wf)

    # ---- shared helpers
    def to(self, state: str, message: str, detail: dict[str, Any] | None = None, **fields: Any) -> None:
        transition(self.session, self.action, state, message, self.now, detail, **fields)

    def fail(self, message: str, detail: dict[str, Any] | None = None) -> None:
        self.to("failed", message, detail, error=message)

    def note(self, message: str, detail: dict[str, Any] | None = None) -> None:
        note_event(self.session, self.action, message, self.now, detail)

    def events(self) -> list[ActionEvent]:
        return list(self.session.scalars(select(ActionEvent).where(ActionEvent.action_id == self.action.id)
                                         .order_by(ActionEvent.id)))

    def commands(self, kind: str, purpose: str | None = None) -> list[Command]:
        rows = self.session.scalars(select(Command).where(Command.action_id == self.action.id, Command.kind == kind)
                                    .order_by(Command.id))
        return [c for c in rows if purpose is None or (c.payload or {}).get("purpose") == purpose]

    def send(self, host_id: str, kind: str, payload: dict[str, Any], deadline_s: float) -> Command:
        ttl = deadline_s + self.options.command_grace_s
        command = enqueue_command(self.session, host_id, kind, {**payload, "deadline_s": deadline_s}, ttl=ttl,
                                  action_id=self.action.id, secret=self.settings.secret_bytes(), now=self.now)
        self.action.attempts = len(self.commands(kind, payload.get("purpose")))
        return command

    def overdue(self, command: Command) -> bool:
        deadline = float((command.payload or {}).get("deadline_s", 0.0)) + self.options.command_grace_s
        return command.status in OUTSTANDING and (self.now > command.issued_at + deadline
                                                  or self.now > command.expires_at)

    def origin(self, wf: Workflow) -> Placement | None:
        return active_placement(self.session, wf.id, self.action.from_device_id) or active_placement(
            self.session, wf.id)

    def host_of(self, device_id: int | None) -> str | None:
        device = self.session.get(Device, device_id) if device_id is not None else None
        return device.host_id if device is not None else None

    # ---- planned: ask for a checkpoint
    def planned(self, wf: Workflow) -> None:
        if not wf.managed or not wf.command:
            self.fail(f"{wf.id} is not a managed job with a registered command line; nothing moved")
            return
        here = self.origin(wf)
        if here is None or here.device_id != self.action.from_device_id:
            self.fail(f"{wf.id} is no longer on device {self.action.from_device_id}; nothing moved")
            return
        if not wf.checkpoint_dir:
            self.fail(f"{wf.id} has no checkpoint folder registered; nothing moved")
            return
        # the plan-level checks ran once, when the move was begun (enforcer.move_checks); this is the actuator's own
        # verification: what would be started is what was signed
        refusal = spec_refusal(wf, self.settings.secret_bytes())
        if refusal is not None:
            self.fail(f"refused: {refusal}; nothing moved, {wf.id} runs on where it is", {"refused": refusal})
            return
        if halt_if_silent(self, wf, []):
            return
        self.ask_checkpoint(wf, here.host_id)
        self.to("checkpoint_requested",
                f"asked {wf.id} on host {here.host_id} to save a checkpoint into {wf.checkpoint_dir}",
                {"host_id": here.host_id, "directory": wf.checkpoint_dir})

    def ask_checkpoint(self, wf: Workflow, host_id: str) -> Command:
        n = len(self.commands("checkpoint")) + 1
        timeout = self.options.checkpoint_timeout_s
        return self.send(host_id, "checkpoint", {
            "workflow_id": wf.id, "request_id": f"action-{self.action.id}-{n}", "directory": wf.checkpoint_dir,
            "timeout_s": timeout}, deadline_s=timeout)

    # ---- checkpoint_requested: wait for the job's answer
    def checkpoint_requested(self, wf: Workflow) -> None:
        sent = self.commands("checkpoint")
        command = sent[-1] if sent else None
        here = self.origin(wf)
        host = here.host_id if here is not None else self.host_of(self.action.from_device_id)
        if (command is None or command.status in OUTSTANDING or self.lost(command)) and halt_if_silent(self, wf, sent):
            return
        if command is None or self.lost(command):
            if len(sent) >= self.options.max_attempts:
                self.fail(f"no agent answered {len(sent)} checkpoint requests for {wf.id}; nothing moved, the job was "
                          f"left as it was on device {self.action.from_device_id}")
                return
            if host is None:
                self.fail(f"the host of device {self.action.from_device_id} is gone; nothing moved")
                return
            self.ask_checkpoint(wf, host)
            self.note(f"the checkpoint request got no answer (agent down or database away); asked {host} again")
            return
        if command.status in OUTSTANDING:
            return
        result = dict(command.result or {})
        if command.status != "done":
            self.fail(f"the agent on {command.host_id} could not ask {wf.id} for a checkpoint "
                      f"({result.get('error') or result.get('reason') or command.status}); nothing moved, the job was "
                      f"left as it was", result)
            return
        status = result.get("status")
        if status == "done" and result.get("checkpoint_id") is not None:
            self.to("checkpointed", f"{wf.id} saved a checkpoint at step {result.get('step')}: {result['url']} "
                    f"({result.get('size_bytes')} bytes, sha256 {str(result.get('sha256'))[:12]}…, recorded by "
                    f"{command.host_id})", result, checkpoint_path=str(result["url"]),
                    checkpoint_id=int(result["checkpoint_id"]),
                    checkpoint_step=None if result.get("step") is None else int(result["step"]))
        elif status == "gone":
            wf.state = "moving"
            self.to("rolling_back", f"{wf.id} is no longer running ({result.get('error')}); restarting it where it "
                    f"was from its last checkpoint", result)
        else:
            self.fail(f"{wf.id} could not checkpoint ({result.get('error') or status}); nothing moved, the job goes "
                      f"on running on device {self.action.from_device_id}", result)

    def lost(self, command: Command) -> bool:
        return self.overdue(command) or (command.status == "failed" and "agent stopped" in str(
            (command.result or {}).get("error", "")))

    # ---- checkpointed: stop the job
    def checkpointed(self, wf: Workflow) -> None:
        since = self.session.scalar(select(ActionEvent.ts).where(  # when it became checkpointed (notes do not count)
            ActionEvent.action_id == self.action.id, ActionEvent.to_state == "checkpointed",
            ActionEvent.from_state != "checkpointed").order_by(ActionEvent.id.desc()).limit(1)) or 0.0
        sent = [c for c in self.commands("stop") if c.issued_at >= since]  # the stops after the newest checkpoint
        command = sent[-1] if sent else None
        here = self.origin(wf)
        host = here.host_id if here is not None else self.host_of(self.action.from_device_id)
        fresh_ok = len(self.commands("checkpoint")) < self.options.max_attempts
        stale = command is not None and bool((command.result or {}).get("stale_checkpoint"))
        known_stopped = command is not None and command.status == "done" and not stale
        if not known_stopped and halt_if_silent(self, wf, [c for c in sent if c.status in OUTSTANDING], sent):
            return
        if command is not None and command.status == "done" and stale:
            wf.state = "running"
            self.ask_checkpoint(wf, host or command.host_id)
            self.to("checkpoint_requested", f"{wf.id} was not stopped: its checkpoint at step "
                    f"{self.action.checkpoint_step} was {(command.result or {}).get('age_s', 0):.0f} s old when the "
                    f"stop reached {command.host_id} (the store or the agent was away) and it trained on; asked for a "
                    "fresh one", dict(command.result or {}))
            return
        if command is None or self.lost(command) or command.status in ("failed", "refused"):
            if command is not None and len(sent) >= self.options.max_attempts:
                wf.state = "running"
                why = f"{wf.id} could not be stopped on {host} after {len(sent)} tries " \
                      f"({(command.result or {}).get('error') or command.status})"
                self.fail(f"{why}; nothing moved, it runs on where it was" if not unsettled(self, sent) else
                          f"{why}, and a stop its agent claimed was never answered: whether it stopped is not known, "
                          f"so it was started nowhere else; its checkpoint is {self.action.checkpoint_path}",
                          dict(command.result or {}))
                return
            if host is None:
                self.fail(f"the host of device {self.action.from_device_id} is gone; {wf.id} was not stopped")
                return
            wf.state = "moving"  # from here the enforcer, not the job's exit, settles the workflow's state
            payload: dict[str, Any] = {"workflow_id": wf.id, "grace_s": self.options.stop_grace_s}
            ckpt = self.session.get(Checkpoint, self.action.checkpoint_id) if self.action.checkpoint_id else None
            if ckpt is not None and fresh_ok:  # a stop that arrives late leaves the job running, for a fresh one
                payload.update(checkpoint_taken_at=ckpt.created_at, max_age_s=self.options.checkpoint_max_age_s)
            self.send(host, "stop", payload, deadline_s=self.options.stop_grace_s + 5)
            self.note(f"stopping {wf.id} on {host} (SIGTERM, SIGKILL after {self.options.stop_grace_s:.0f} s)"
                      + (" again: the last stop got no answer" if command is not None else ""))
            return
        if command.status in OUTSTANDING:
            return
        result = dict(command.result or {})
        killed = f", killed {result['killed']} after the grace period" if result.get("killed") else ""
        what = ("was already stopped" if result.get("already_stopped")
                else f"stopped (pids {result.get('stopped')}{killed})")
        self.to("stopped", f"{wf.id} {what}", result)

    # ---- stopped: relaunch at the target
    def stopped(self, wf: Workflow) -> None:
        if roll_back_if_target_silent(self, wf):
            return
        self.relaunch(wf, purpose="move")

    def relaunch(self, wf: Workflow, *, purpose: str) -> None:
        move = purpose == "move"
        sent = self.commands("relaunch", purpose)
        command = sent[-1] if sent else None
        if command is not None and command.status in OUTSTANDING and not self.lost(command):
            return
        if command is not None and command.status == "done":
            self.relaunched_at(wf, command, move)
            return
        if command is not None and command.status == "failed" and (command.result or {}).get("unsafe"):
            why = (command.result or {}).get("error")
            if move:
                self.to("rolling_back", f"the agent on {command.host_id} refused to start {wf.id} ({why}); putting "
                        "it back where it was", dict(command.result or {}))
            else:
                wf.state = "failed"  # nothing that cannot be verified runs: its owner must start it again
                self.fail(f"the agent on {command.host_id} refused to restart {wf.id} where it was ({why}); it is "
                          f"stopped and nothing unverified was run, its checkpoint is "
                          f"{self.action.checkpoint_path or '(none)'}: start it again with `fleetlens run`",
                          dict(command.result or {}))
            return
        if command is not None and len(sent) >= self.options.max_attempts:
            why = (command.result or {}).get("error") or ("no answer" if command.status in OUTSTANDING
                                                          else command.status)
            if move:
                self.to("rolling_back", f"{wf.id} could not be started on device {self.action.to_device_id} after "
                        f"{len(sent)} tries ({why}); putting it back where it was", dict(command.result or {}))
            else:
                wf.state = "failed"  # stopped, and nowhere to run: its owner must start it again
                self.fail(f"{wf.id} could not be restarted where it was after {len(sent)} tries ({why}); it is "
                          f"stopped, its checkpoint is {self.action.checkpoint_path or '(none)'}: start it again "
                          "with `fleetlens run`", dict(command.result or {}))
            return
        device_id, lane_id = self.destination(wf, move)
        host = self.host_of(device_id)
        if host is None:
            if move:
                self.to("rolling_back", f"target device {device_id} is gone; putting {wf.id} back where it was")
            else:
                self.fail(f"device {device_id} where {wf.id} ran is gone; it is stopped, its checkpoint is "
                          f"{self.action.checkpoint_path}")
            return
        checkpoint_id, resume_from, resume_step = self.resume_point(wf)
        p_prime, e = self.job_profile(wf)  # its memory cap in the new lane: what that lane admits it with
        self.send(host, "relaunch", {
            "workflow_id": wf.id, "device_id": device_id, "lane_id": lane_id, "checkpoint_id": checkpoint_id,
            "resume_folder": None if checkpoint_id is not None else wf.checkpoint_dir, "purpose": purpose,
            "timeout_s": self.options.start_timeout_s,
            "share_bytes": p_prime + e if move and lane_id is not None and p_prime else None,
        }, deadline_s=self.options.start_timeout_s + 5)
        where = f"device {device_id}{f' lane {lane_id}' if lane_id else ''} on {host}"
        again = ""
        if command is not None:
            last = ("got no answer" if command.status in OUTSTANDING
                    else f"failed: {(command.result or {}).get('error')}")
            again = f" (again: the last try {last})"
        self.note(f"starting {wf.id} on {where} from {resume_from or 'its newest checkpoint there, if any'}{again}",
                  {"checkpoint_id": checkpoint_id, "resume_from": resume_from, "resume_step": resume_step})

    def destination(self, wf: Workflow, move: bool) -> tuple[int, int | None]:
        if move:
            return int(self.action.to_device_id), self.action.to_lane_id
        here = active_placement(self.session, wf.id, self.action.from_device_id)
        if here is None:  # the move got as far as the target: its old lane, if that is still open
            here = self.session.scalar(select(Placement).where(
                Placement.workflow_id == wf.id, Placement.device_id == self.action.from_device_id)
                .order_by(Placement.id.desc()).limit(1))
            lane = self.session.get(Lane, here.lane_id) if here is not None and here.lane_id is not None else None
            return int(self.action.from_device_id), lane.id if lane is not None and lane.state == "open" else None
        return int(self.action.from_device_id), here.lane_id

    def resume_point(self, wf: Workflow) -> tuple[int | None, str | None, int | None]:
        """(checkpoint id, location, step) to resume from: the move's recorded checkpoint, else the newest recorded
        one. Whether it can be read, and is intact, the agent that starts the job checks (not this host's disk)."""
        if self.action.checkpoint_id is not None:
            return self.action.checkpoint_id, self.action.checkpoint_path, self.action.checkpoint_step
        fact = latest_checkpoint(self.session, wf.id)
        if fact is not None:
            return fact.id, fact.url, fact.step
        return None, None, None

    def planned_detail(self) -> dict[str, Any]:
        planned = self.session.scalar(select(ActionEvent).where(
            ActionEvent.action_id == self.action.id, ActionEvent.to_state == "planned").order_by(ActionEvent.id))
        return dict(planned.detail or {}) if planned is not None else {}

    def job_profile(self, wf: Workflow) -> tuple[int, int]:
        """(P', E) the move was planned with: its memory cap in the new lane."""
        detail = self.planned_detail()
        if detail.get("p_prime") is not None:
            return int(detail["p_prime"]), int(detail.get("ephemeral") or 0)
        return admitted_profile(wf, active_placement(self.session, wf.id))

    def job_memory(self, wf: Workflow) -> tuple[int | None, int]:
        """(P, E) as measured that the new placement records (P None: a move planned before P was kept with it)."""
        detail = self.planned_detail()
        if detail.get("persistent") is not None:
            return int(detail["persistent"]), int(detail.get("ephemeral") or 0)
        here = active_placement(self.session, wf.id)
        if here is not None and here.mem_persistent is not None:
            return int(here.mem_persistent), int(detail.get("ephemeral") or here.mem_ephemeral or 0)
        return (int(wf.mem_persistent) if wf.mem_persistent else None), int(detail.get("ephemeral") or 0)

    def relaunched_at(self, wf: Workflow, command: Command, move: bool) -> None:
        result = dict(command.result or {})
        pid = int(result["pid"])
        device_id, lane_id = self.destination(wf, move)
        old = list(self.session.scalars(select(Placement).where(
            Placement.workflow_id == wf.id, Placement.state.in_(("active", "pending")))))
        persistent, e = self.job_memory(wf)
        share = 1.0
        if lane_id is not None:
            lane = self.session.get(Lane, lane_id)
            share = lane.compute_share if lane is not None else 1.0
        for p in old:
            p.state, p.ended_at = "ended", self.now
        self.session.add(Placement(workflow_id=wf.id, device_id=device_id, lane_id=lane_id,
                                   host_id=command.host_id, pid=pid, mem_persistent=persistent, mem_ephemeral=e,
                                   compute_share=share, state="active", started_at=self.now))
        self.session.flush()
        close_empty_lanes(self.session, {p.lane_id for p in old if p.lane_id is not None and p.lane_id != lane_id},
                          self.now)
        wf.state = "running"
        where = f"device {device_id}{f' lane {lane_id}' if lane_id else ''} on {command.host_id}"
        start = result.get("already_running") and "(it was already running there)" or (
            f"from step {self.action.checkpoint_step}" if self.action.checkpoint_step is not None else "")
        detail = {**result, "device_id": device_id, "lane_id": lane_id}
        if move:
            self.to("relaunched", f"{wf.id} started on {where} as pid {pid} {start}".strip(), detail)
        else:
            self.to("rolled_back", f"{wf.id} is running again where it was, {where}, as pid {pid} {start}".strip(),
                    detail)

    # ---- relaunched: wait for the job to report progress from its checkpoint
    def relaunched(self, wf: Workflow) -> None:
        command = self.commands("relaunch", "move")[-1]
        pid = int((command.result or {})["pid"])
        # the new process's steps: its pid on its host (the job ran as that pid on another host before, maybe)
        first = self.session.scalar(select(StepStat).where(
            StepStat.workflow_id == wf.id, StepStat.host_id == command.host_id, StepStat.pid == pid)
            .order_by(StepStat.first_step).limit(1))
        expected = self.action.checkpoint_step
        if first is not None:
            if expected is not None and first.first_step < expected:
                self.unwind(wf, command.host_id, f"{wf.id} resumed at step {first.first_step} as pid {pid}, below its "
                            f"checkpoint step {expected}: work would be redone or lost",
                            {"pid": pid, "first_step": first.first_step, "checkpoint_step": expected})
                return
            gap = expected is not None and first.first_step > expected
            self.to("resumed", f"{wf.id} resumed at step {first.first_step} (checkpoint step {expected}) as pid {pid}"
                    f"{'; steps between were not reported' if gap else ''}",
                    {"pid": pid, "first_step": first.first_step, "checkpoint_step": expected})
            return
        if wf.state in ("finished",):
            self.to("resumed", f"{wf.id} finished after its relaunch as pid {pid}", {"pid": pid})
            return
        if wf.state == "failed":  # the agent saw the new process die before it reported a single step
            wf.state = "moving"
            self.to("rolling_back", f"{wf.id} died as pid {pid} on device {self.action.to_device_id} before it "
                    f"reported a step (see its log {(command.result or {}).get('log')}); putting it back where it "
                    "was, from its checkpoint", {"pid": pid})
            return
        if self.now - self.action.updated_at > self.options.resume_timeout_s:
            self.unwind(wf, command.host_id, f"{wf.id} was started as pid {pid} but reported no step within "
                        f"{self.options.resume_timeout_s:.0f} s (see its log {(command.result or {}).get('log')})",
                        {"pid": pid})

    def unwind(self, wf: Workflow, host: str, why: str, detail: dict[str, Any]) -> None:
        """Stop the relaunched job at the target and roll back: it is started where it was, from its checkpoint."""
        wf.state = "moving"
        self.send(host, "stop", {"workflow_id": wf.id, "grace_s": self.options.stop_grace_s, "purpose": "unwind"},
                  deadline_s=self.options.stop_grace_s + 5)
        self.to("rolling_back", f"{why}; stopping it on {host} and putting it back where it was, from its "
                "checkpoint", detail)

    # ---- rolling back: relaunch where it was, from its checkpoint
    def rolling_back(self, wf: Workflow) -> None:
        unwinds = self.commands("stop", "unwind")
        if unwinds:
            last = unwinds[-1]
            if last.status in OUTSTANDING and not self.lost(last):
                return
            if last.status != "done":
                if len(unwinds) >= self.options.max_attempts:
                    self.fail(f"{wf.id} could not be stopped on {last.host_id} after {len(unwinds)} tries "
                              f"({(last.result or {}).get('error') or last.status}); it was not started again where "
                              "it was, so that it never runs twice", dict(last.result or {}))
                    return
                self.send(last.host_id, "stop", {"workflow_id": wf.id, "grace_s": self.options.stop_grace_s,
                                                 "purpose": "unwind"}, deadline_s=self.options.stop_grace_s + 5)
                self.note(f"stopping {wf.id} on {last.host_id} again: the last stop got no answer")
                return
        if fencing(self, wf):
            return
        self.relaunch(wf, purpose="rollback")


STEPS = {
    "planned": StepRunner.planned,
    "checkpoint_requested": StepRunner.checkpoint_requested,
    "checkpointed": StepRunner.checkpointed,
    "stopped": StepRunner.stopped,
    "relaunched": StepRunner.relaunched,
    "rolling_back": StepRunner.rolling_back,
}

