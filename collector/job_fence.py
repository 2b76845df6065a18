"""Fencing: the agent stops a copy of a managed job that runs on its host although the store places the job elsewhere.

A move can end with the job put back on its source while a copy may run at the target: the target's agent claimed
the relaunch, started the job, and was cut off from the database before it could say so (enforcer.move_silence puts
the job back once that relaunch's deadline has passed). Both copies would resume from the same checkpoint location,
and the older one would overwrite the newer one's checkpoints. The store cannot reach a host it does not hear from, so
that host's agent fences itself when it is heard from again: at its start and after every database outage (then
before any command it runs), and every `FENCE_EVERY_S` besides, it looks at the managed jobs running on its host
(found by their environment, as the reaper finds them: never a process fleetlens did not start) and stops, without a
checkpoint (SIGTERM, SIGKILL after the grace period), each one whose workflow

- has no active or pending placement on this host,
- has an active placement on another host (the store runs it there), and
- has no move under way (every action of it is over: resumed, rolled back or failed), so a job started here by a
  move the enforcer has not yet recorded is left alone.

Each such stop is recorded as a host event (kind `fence`) and noted on the job's last move that named this host.

So that the two copies do not run side by side while the agent is cut off, it also holds a lease (`lapse`, every
round of its commander, the database up or not): a start for a move whose outcome the database could not take is
stopped as soon as its relaunch command expires, the moment the enforcer takes it for lost; the enforcer puts the
job back on its source only some time after that expiry (enforcer.move_silence.fencing).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import or_, select

from collector.command_runner import CommandRunner
from collector.job_control import DEFAULT_STOP_GRACE_S, stop_tree
from collector.job_reaper import REAPER, alive
from collector.launch import find_managed_processes
from collector.sdk_handlers import LaneGate
from store.db import Store
from store.models import Action, ActionEvent, Device, Placement
from store.placements import MOVE_OVER
from store.registry import record_host_event

log = logging.getLogger(__name__)

FENCE_EVERY_S = 30.0  # besides at the agent's start and after each database outage


@dataclass(frozen=True)
class Stale:
    """A managed job running here that the store places on `placed_on` (host), its move over."""

    workflow_id: str
    placed_on: str
    action_id: int | None  # its last move that named this host, if any


def stale_here(store: Store, host_id: str, workflow_ids: list[str]) -> list[Stale]:
    """Of these workflows running on `host_id`, those the store places on another host with no move under way."""
    if not workflow_ids:
        return []
    out = []
    with store.session() as session:
        for workflow_id in workflow_ids:
            placements = list(session.scalars(select(Placement).where(
                Placement.workflow_id == workflow_id, Placement.state.in_(("active", "pending")))))
            if any(p.host_id == host_id for p in placements):
                continue  # placed here: it is this host's to run
            elsewhere = [p.host_id for p in placements if p.state == "active" and p.host_id != host_id]
            if not elsewhere:
                continue  # placed nowhere: whatever ended it, no other copy runs to be clobbered
            if session.scalar(select(Action.id).where(Action.workflow_id == workflow_id,
                                                      Action.state.not_in(MOVE_OVER)).limit(1)) is not None:
                continue  # a move under way may have started it here and not recorded it yet
            here = select(Device.id).where(Device.host_id == host_id)
            action_id = session.scalar(select(Action.id).where(
                Action.workflow_id == workflow_id,
                or_(Action.to_device_id.in_(here), Action.from_device_id.in_(here))).order_by(Action.id.desc())
                .limit(1))
            out.append(Stale(workflow_id, elsewhere[0], action_id))
    return out


def fence(store: Store, host_id: str, *, gate: LaneGate | None = None, grace_s: float = DEFAULT_STOP_GRACE_S,
          now: float | None = None) -> list[dict[str, Any]]:
    """Stop the managed jobs on this host that the store runs elsewhere, their move over; returns what was stopped
    ({workflow_id, placed_on, action_id, stopped, killed} each). Raises DatabaseUnavailable when the store is away
    (nothing is stopped then)."""
    running = {wf: [p for p in procs if alive(p)] for wf, procs in find_managed_processes(host_id).items()}
    running = {wf: procs for wf, procs in running.items() if procs}
    stale = stale_here(store, host_id, sorted(running))
    done: list[dict[str, Any]] = []
    for s in stale:
        procs = running[s.workflow_id]
        REAPER.forget([p.pid for p in procs])  # its end is no ending of the job, which runs on elsewhere
        stopped, killed = stop_tree(procs, grace_s)
        if gate is not None:
            gate.release(s.workflow_id)  # a turn the copy held in a lane here passes on
        done.append({"workflow_id": s.workflow_id, "placed_on": s.placed_on, "action_id": s.action_id,
                     "stopped": stopped, "killed": killed, "message": (
                         f"stopped {s.workflow_id} (pids {stopped}, without a checkpoint) on {host_id}: the store "
                         f"runs it on {s.placed_on} and its move is over, so this copy was stale (its start here was "
                         "never recorded) and would have written over that one's checkpoints")})
        log.warning("fenced: stopped %s (pids %s) on %s: the store runs it on %s and its move is over",
                    s.workflow_id, stopped, host_id, s.placed_on)
    if done:
        _record(store, host_id, done, time.time() if now is None else now)
    return done


def lapse(runner: CommandRunner, host_id: str, *, gate: LaneGate | None = None,
          grace_s: float = DEFAULT_STOP_GRACE_S, now: float | None = None) -> list[dict[str, Any]]:
    """Stop each job this agent started for a move whose start the database never took, once its relaunch command
    has expired: from then on the enforcer takes the relaunch for lost and may put the job back on its source. Needs
    no database (the agent may be cut off from it); the relaunch's outcome becomes a failure saying so, recorded
    when the database is back. Returns what was stopped, as `fence` does."""
    now = time.time() if now is None else now
    done: list[dict[str, Any]] = []
    due = [u for u in runner.outcomes_unreported() if u.command.kind == "relaunch" and u.status == "done"
           and u.command.payload.get("purpose") == "move" and now > u.command.expires_at]
    for u in due:
        workflow_id, pid = str(u.command.payload["workflow_id"]), u.result.get("pid")
        procs = [p for p in find_managed_processes(host_id).get(workflow_id, []) if alive(p)]
        REAPER.forget([p.pid for p in procs])  # its end is no ending of the job, which is put back elsewhere
        stopped, killed = stop_tree(procs, grace_s) if procs else ([], [])
        if gate is not None:
            gate.release(workflow_id)
        message = (f"stopped {workflow_id} (pids {stopped}, without a checkpoint) on {host_id}: started here as pid "
                   f"{pid} by the relaunch of a move, it could not be reported before the relaunch expired (the "
                   "database was away), so the move takes it for lost and puts the job back where it was; this copy "
                   "would have run beside that one")
        u.status, u.result = "failed", {**u.result, "error": message, "fenced": True, "stopped": stopped}
        done.append({"workflow_id": workflow_id, "placed_on": None, "action_id": u.command.action_id,
                     "stopped": stopped, "killed": killed, "message": message})
        log.warning("fenced: %s", message)
    return done


def _record(store: Store, host_id: str, done: list[dict[str, Any]], now: float) -> None:
    with store.session() as session:
        for d in done:
            message = d["message"]
            d = {k: v for k, v in d.items() if k != "message"}
            record_host_event(session, host_id, "fence", "warning", message, d, now=now)
            action = session.get(Action, d["action_id"]) if d["action_id"] is not None else None
            if action is not None:
                session.add(ActionEvent(action_id=action.id, ts=now, from_state=action.state, to_state=action.state,
                                        message=message, detail={**d, "fenced_host": host_id}))


class Fencer:
    """When the agent's commander fences: first round, after each outage, and every `every_s`."""

    def __init__(self, store: Store, host_id: str, gate: LaneGate | None = None,
                 every_s: float = FENCE_EVERY_S) -> None:
        self.store, self.host_id, self.gate, self.every_s = store, host_id, gate, every_s
        self.last: float | None = None  # monotonic time of the last fence; None: due at once
        self.owed: list[dict[str, Any]] = []  # stops made with the database away, to record when it is back

    def outage(self) -> None:
        """The database was away: fence before the next command runs."""
        self.last = None

    def lapsed(self, runner: CommandRunner, now: float | None = None) -> list[dict[str, Any]]:
        """Every round of the commander, the database up or not: `lapse`."""
        done = lapse(runner, self.host_id, gate=self.gate, now=now)
        self.owed.extend(done)
        return done

    def maybe(self) -> list[dict[str, Any]]:
        """Record the stops owed, and fence when due. Raises DatabaseUnavailable when the store is away."""
        if self.owed:
            _record(self.store, self.host_id, self.owed, time.time())
            self.owed = []
        if self.last is not None and time.monotonic() - self.last < self.every_s:
            return []
        done = fence(self.store, self.host_id, gate=self.gate)
        self.last = time.monotonic()
        return done

