"""`fleetlens run -- CMD` (start a managed job), `fleetlens move` (migrate one by hand) and `fleetlens drive`
(carry out planned migrations)."""

from __future__ import annotations

import math
import shlex

import typer
from rich.table import Table

from enforcer.actuators.drive import drive_actions
from enforcer.migration import action_log, start_migration
from enforcer.policies import get_policy
from store.errors import InvalidInput
from ui.cli.app import app, console, err_console, open_store, settings
from ui.serve.run import run_managed


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def run(
    ctx: typer.Context,
    gpus: int = typer.Option(None, "--gpus", help="Whole devices for the job (default 1)."),
    lane: str = typer.Option(None, "--lane", help="'auto': a Salus lane the active policy picks."),
    movable: bool = typer.Option(False, "--movable", help="The enforcer may move this job (by checkpoint)."),
    team: str = typer.Option(None, "--team", help="The job's team (teams may be movable as a whole)."),
    steps: int = typer.Option(None, "--steps", help="Declared training steps (SRTF's remaining time)."),
    name: str = typer.Option(None, "--name", help="The job's name; the workflow id is NAME-xxxxxx."),
    mem_mb: float = typer.Option(None, "--mem-mb", help="Persistent memory per device, MB (else the last run's)."),
    util: float = typer.Option(1.0, "--util", help="Expected device utilisation alone, 0..1 (PACK packs light jobs)."),
    policy: str = typer.Option(None, "--policy", help="Placement policy (default: FLEETLENS_POLICY)."),
    detach: bool = typer.Option(False, "--detach", help="The host's agent starts and owns the job; return at once."),
    device: list[int] = typer.Option(None, "--device", help="Only place on this device id (repeatable)."),
    checkpoint_url: str = typer.Option(
        None, "--checkpoint-url", help="Where the job checkpoints, an fsspec URL (shared folder, s3://...; default "
        "FLEETLENS_CHECKPOINT_URL, else this host's FLEETLENS_HOME). Moves to another host need one it can read."),
) -> int:
    """Start CMD as a managed job: registered, placed under the policy, and movable by the enforcer if allowed."""
    command = list(ctx.args)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise InvalidInput("no command to run; put it after `--`, e.g. `fleetlens run -- python train.py`")
    if mem_mb is not None and not 0 < mem_mb < math.inf:  # a negative figure would be stored as the job's memory
        raise InvalidInput(f"--mem-mb must be a positive number of MB, not {mem_mb}")
    s = settings()
    get_policy(policy or s.policy)  # one line for an unknown policy, before the database is touched
    store = open_store()
    job, code = run_managed(
        store, command, detach=detach, settings=s, gpus=gpus, lane=lane, movable=movable, team=team, steps=steps,
        name=name, mem_bytes=None if mem_mb is None else int(mem_mb * 2**20), util=util, policy=policy,
        devices=device or None, checkpoint_url=checkpoint_url,
    )
    where = f"device(s) {', '.join(map(str, job.device_ids))}" + (f" lane {job.lane_id}" if job.lane_id else "")
    if detach:
        console.print(f"{job.workflow_id}: started by the agent on {job.host_id} {where} as pid {job.pid} "
                      f"({job.policy}); log {job.log_path}", highlight=False)
        return 0
    err_console.print(f"{job.workflow_id}: `{shlex.join(command)}` on {where} ended with exit code {code}",
                      highlight=False)
    return int(code or 0)


@app.command()
def move(
    workflow: str = typer.Argument(..., help="The managed job to move."),
    to_device: int = typer.Option(..., "--to-device", help="Target device id."),
    to_lane: int = typer.Option(None, "--to-lane", help="An existing lane on the target device."),
    lane_mb: float = typer.Option(None, "--lane-mb", help="Open a new lane of this many MB on the target."),
    wait: bool = typer.Option(True, "--wait/--no-wait", help="Drive the migration to its end."),
    timeout: float = typer.Option(600.0, "--timeout", help="Seconds to wait at most."),
) -> None:
    """Move one managed job by checkpoint and relaunch (what an applied plan does for each of its moves)."""
    if lane_mb is not None and not 0 < lane_mb < math.inf:
        raise InvalidInput(f"--lane-mb must be a positive number of MB, not {lane_mb}")
    _check_timeout(timeout)  # before the move is recorded: a bad one would leave it planned and not driven
    store = open_store()
    action_id = start_migration(store, workflow, to_device, to_lane_id=to_lane, settings=settings(),
                                new_lane_size=None if lane_mb is None else int(lane_mb * 2**20))
    console.print(f"action {action_id}: {workflow} -> device {to_device} planned")
    if wait:
        _show(store, drive_actions(store, settings(), action_ids=[action_id], timeout_s=timeout))


@app.command()
def drive(
    plan: int = typer.Option(None, "--plan", help="Only this plan's actions."),
    timeout: float = typer.Option(600.0, "--timeout", help="Seconds to wait at most."),
) -> None:
    """Carry out planned migrations (checkpoint, stop, relaunch, resume) until each is done, rolled back or failed."""
    _check_timeout(timeout)
    store = open_store()
    states = drive_actions(store, settings(), plan_id=plan, timeout_s=timeout)
    if not states:
        console.print("no unfinished actions")
        return
    _show(store, states)


def _check_timeout(timeout: float) -> None:
    if not 0 <= timeout < math.inf:  # NaN too: its deadline never comes, and the drive would never end
        raise InvalidInput(f"--timeout must be a finite number of seconds, 0 or more, not {timeout}")


def _show(store, states: dict[int, str]) -> None:
    """Each action driven: its state and what happened to it."""
    table = Table(title="migrations")
    for column in ("action", "state", "what happened"):
        table.add_column(column)
    for action_id, state in states.items():
        events = action_log(store, action_id)
        table.add_row(str(action_id), state, "\n".join(e["message"] for e in events))
    console.print(table)
