"""What a move under way does when a host it depends on goes silent: it stops waiting for answers that cannot come.

A move is begun only while both its hosts are heard from (enforcer.move_checks); one may fall silent after (its agent
crashed, the host went off or was cut off). Each step of the agents' state machine (enforcer.migration_steps) that
waits on a host asks, with the one rule (store.registry.silent_hosts over `Settings.host_silence_s`,
FLEETLENS_HOST_SILENT_AFTER_S), whether it has gone silent, and acts at once rather than after its commands'
deadlines:

- before the job is stopped (planned, checkpoint_requested, checkpointed with no stop answered): the move ends
  `failed`, the job left running where it is; its commands no agent has claimed yet are withdrawn
  (store.commands.withdraw_pending), so an agent that comes back never stops the job for a move that is over;
- a stop the source's agent claimed and never answered: if the source is the silent one, whether the job stopped is
  not known, and the move ends `failed` saying so (nothing is started anywhere else, where it might run twice); if
  the target is, the stop's own deadline is awaited (the job may be stopping), then the job is put back where it was
  (`rolling_back`: the source's agent starts it from its checkpoint only if it is not running);
- after the job stopped (`stopped`, the relaunch at the target unanswered): the relaunches no agent has claimed are
  withdrawn and the job is put back where it was at once, from its checkpoint. A relaunch the target's agent
  claimed is awaited until its deadline, as before.

A job started at the target before the target fell silent (`relaunched`) is left to the resume timeout, and a roll
back to a silent source to its relaunch's tries: there the job may be running, and only its agent can say.

A roll back after a relaunch the target's agent claimed and never answered starts the job where it was only once
that relaunch has expired by more than the time its agent takes to stop an unreported start (`fencing`;
collector.job_fence is the agent's side, and also stops, when the agent is heard from again, a copy the store
places elsewhere), so the job never runs at both ends.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from sqlalchemy.orm import Session

from enforcer.move_checks import silence_phrase
from store.commands import withdraw_pending
from store.models import Action, ActionEvent, Command, Workflow
from store.registry import silent_hosts
from store.settings import Settings


class StepRunner(Protocol):
    """What this module uses of a step of the state machine (enforcer.migration_steps.StepRunner)."""

    session: Session
    action: Action
    settings: Settings
    options: Any  # enforcer.migration_steps.MigrationOptions: stop_grace_s, command_grace_s
    now: float

    def host_of(self, device_id: int | None) -> str | None: ...
    def commands(self, kind: str, purpose: str | None = None) -> list[Command]: ...
    def lost(self, command: Command) -> bool: ...
    def overdue(self, command: Command) -> bool: ...
    def fail(self, message: str, detail: dict[str, Any] | None = None) -> None: ...
    def note(self, message: str, detail: dict[str, Any] | None = None) -> None: ...
    def send(self, host_id: str, kind: str, payload: dict[str, Any], deadline_s: float) -> Command: ...
    def events(self) -> list[ActionEvent]: ...
    def to(self, state: str, message: str, detail: dict[str, Any] | None = None, **fields: Any) -> None: ...


def silent_of(step: StepRunner, hosts: Iterable[str | None]) -> dict[str, str]:
    """{host: why it is not heard from} of these hosts that have gone silent."""
    return silent_hosts(step.session, {h for h in hosts if h}, step.settings.host_silence_s, step.now)


def unsettled(step: StepRunner, stops: Iterable[Command]) -> list[Command]:
    """The stops an agent claimed and never answered (still running, or cut short by its agent's own end): the job
    may or may not have stopped."""
    return [c for c in stops if c.status == "running" or (c.status == "failed" and step.lost(c))]


def halt_if_silent(step: StepRunner, wf: Workflow, waiting: list[Command], stops: list[Command] = ()) -> bool:
    """Before the job is known stopped: whether the move ended (or waits on a stop's answer) because its source or
    target has gone silent. `waiting`: the step's unanswered commands, withdrawn unless an agent claimed them;
    `stops`: the stops sent since the newest checkpoint."""
    source, target = step.host_of(step.action.from_device_id), step.host_of(step.action.to_device_id)
    silent = silent_of(step, (source, target))
    if not silent:
        return False
    host = source if source in silent else target
    quiet = silence_phrase(host, silent[host])
    withdrawn = withdraw_pending(step.session, [c.id for c in waiting if c.status == "pending"],
                                 f"host {host} went silent during the move", now=step.now)
    detail = {"silent_host": host, "silent_because": silent[host], "withdrawn_commands": withdrawn}
    claimed = unsettled(step, stops)
    where = f"device {step.action.from_device_id} on {source}"
    if claimed and host == source:
        settle(wf)  # its agent settles it when heard from again: it reports the job gone if it stopped
        step.fail(f"given up: {quiet} and its agent never answered the stop it claimed: whether {wf.id} stopped is "
                  f"not known, so it was started nowhere else; its placement stays on {where}, and its checkpoint "
                  f"is {step.action.checkpoint_path}", detail)
        return True
    if claimed:
        if any(c.status == "running" and not step.overdue(c) for c in claimed):
            return True  # the job may be stopping right now: the stop's answer, or its deadline, comes first
        wf.state = "moving"
        step.to("rolling_back", f"{quiet}: its agent could not start {wf.id}, and the stop {source} claimed got no "
                f"answer; putting {wf.id} back where it was, from its checkpoint (started only if it is not running "
                "there)", detail)
        return True
    settle(wf)
    if host == source:
        step.fail(f"given up: {quiet}: its agent cannot checkpoint or stop {wf.id}; nothing was stopped and nothing "
                  f"moved, {wf.id} was left as it was on {where}", detail)
    else:
        step.fail(f"abandoned: {quiet}: its agent could not start {wf.id}; nothing was stopped, {wf.id} runs on "
                  f"where it is, on {where}", detail)
    return True


def settle(wf: Workflow) -> None:
    """The move is over with the job where it was: a job the move had taken over ("moving", a stop sent) is the
    agents' to report again; one that finished or failed meanwhile stays so."""
    if wf.state == "moving":
        wf.state = "running"


def fencing(step: StepRunner, wf: Workflow) -> bool:
    """Whether the roll back waits before starting the job where it was: a relaunch at the target that its agent
    claimed and never answered may have started the job there. That agent stops such a start once the relaunch has
    expired without its outcome reaching the store (collector.job_fence.lapse), within the stop's grace; this waits
    for that, and for a command grace of clock skew between the hosts, so that the job never runs twice."""
    sent = step.commands("relaunch", "move")
    recorded = {(e.detail or {}).get("pid") for e in step.events() if e.to_state == "relaunched"}
    late = [c for c in sent if c.status == "done" and (c.result or {}).get("pid") not in recorded]
    if late and not step.commands("stop", "unwind"):
        # its answer came after the move had given up on it (the hosts' clocks differ): the job runs there, unknown
        # to the move; it is stopped there first (the unwind's stop), as a relaunched job is
        last = late[-1]
        step.send(last.host_id, "stop", {"workflow_id": wf.id, "grace_s": step.options.stop_grace_s,
                                         "purpose": "unwind"}, deadline_s=step.options.stop_grace_s + 5)
        step.note(f"{wf.id} was started on {last.host_id} as pid {(last.result or {}).get('pid')} after the move had "
                  f"given up on that relaunch; stopping it there before starting it where it was")
        return True
    claimed = [c for c in sent if c.status == "running"]
    if not claimed:
        return False
    until = max(c.expires_at for c in claimed) + step.options.stop_grace_s + 5 + step.options.command_grace_s
    if step.now > until:
        return False
    if not any((e.detail or {}).get("awaiting_fence") for e in step.events()):
        step.note(f"the relaunch of {wf.id} at {claimed[-1].host_id} was claimed and never answered: waiting until "
                  f"{until - step.now:.0f} s from now, by when its agent has stopped any copy it started, before "
                  "starting it where it was", {"awaiting_fence": True, "until": until})
    return True


def roll_back_if_target_silent(step: StepRunner, wf: Workflow) -> bool:
    """After the job stopped, before it started at the target: whether the move is put back where it was (or waits on
    a relaunch the target's agent claimed) because the target has gone silent."""
    target = step.host_of(step.action.to_device_id)
    silent = silent_of(step, (target,))
    if not silent:
        return False
    sent = step.commands("relaunch", "move")
    if any(c.status == "done" for c in sent):
        return False  # it answered before it fell silent: the job started there, its resume decides
    withdrawn = withdraw_pending(step.session, [c.id for c in sent if c.status == "pending"],
                                 f"host {target} went silent during the move", now=step.now)
    if any(c.status == "running" and not step.overdue(c) for c in sent):
        return True  # its agent claimed a relaunch: its answer, or its deadline, comes first
    quiet = silence_phrase(target, silent[target])
    step.to("rolling_back", f"{quiet}: its agent cannot start {wf.id}; putting it back where it was, from its "
            "checkpoint, at once", {"silent_host": target, "silent_because": silent[target],
                                    "withdrawn_commands": withdrawn})
    return True
