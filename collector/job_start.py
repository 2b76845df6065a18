"""The agent's `launch` and `relaunch` commands: start a managed job's signed spec on its devices or lane.

A launch or relaunch runs only the spec registered for the workflow (never one from the command), and only when its
digest matches the signature made at registration; it resumes only from a recorded checkpoint inside the workflow's
checkpoint location whose sha256 this host has checked. What fails those checks is refused (the command fails as
unsafe, the enforcer puts the job back or leaves it stopped with its checkpoint). Both are idempotent: a job that
already runs is returned as it is, because the enforcer re-sends a command whose outcome it never saw.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import fsspec

from collector.command_runner import CommandContext
from collector.job_reaper import REAPER, alive
from collector.launch import find_job_processes, job_env, spawn_job
from collector.oom import START_MARK
from store.checkpoints import digest, get_checkpoint, is_local, local_path
from store.errors import InvalidInput, NotFound, UnsafeToRun
from store.models import Workflow
from store.paths import log_path_for
from store.placements import mark_started
from store.workflows import spec_refusal

DEFAULT_START_TIMEOUT_S = 3.0  # seconds a started job must survive (or say hello sooner)


def workflow_spec(ctx: CommandContext, workflow_id: str, *, verify_spec: bool = True) -> dict[str, Any]:
    """The workflow's registered relaunch spec; raises UnsafeToRun when it does not match its signature."""
    with ctx.store.session() as session:
        wf = session.get(Workflow, workflow_id)
        if wf is None:
            raise NotFound(f"workflow {workflow_id!r} is not in the store")
        if not wf.managed or not wf.command:
            raise InvalidInput(f"workflow {workflow_id!r} is not a managed job with a registered command line")
        if verify_spec:
            refusal = spec_refusal(wf, ctx.settings.secret_bytes())
            if refusal is not None:
                raise UnsafeToRun(f"refused on host {ctx.host_id}: {refusal}; nothing was started")
        return {"id": wf.id, "command": list(wf.command), "cwd": wf.cwd or "/", "checkpoint_dir": wf.checkpoint_dir,
                "checkpoint_url": wf.checkpoint_url}


def _inside(url: str, location: str) -> bool:
    if is_local(url) and is_local(location):
        return local_path(url).resolve().is_relative_to(local_path(location).resolve())
    return url.startswith(location.rstrip("/") + "/")


def _verified_checkpoint(ctx: CommandContext, wf: dict[str, Any], checkpoint_id: int) -> tuple[str, int | None]:
    """(local path to resume from, its step) of a recorded checkpoint whose bytes this host read and found to match
    the sha256 the writing agent recorded; raises UnsafeToRun otherwise (nothing is started)."""
    with ctx.store.session() as session:
        fact = get_checkpoint(session, checkpoint_id)
    if fact is None or fact.workflow_id != wf["id"]:
        raise UnsafeToRun(f"checkpoint {checkpoint_id} is not a recorded checkpoint of {wf['id']}; nothing started")
    location = wf["checkpoint_url"] or wf["checkpoint_dir"] or ""
    if not location or not _inside(fact.url, location):
        raise UnsafeToRun(f"refusing to resume {wf['id']} from {fact.url}: not inside its checkpoint location "
                          f"{location}; nothing started")
    try:
        sha, size = digest(fact.url)
    except (OSError, ImportError, ValueError) as exc:
        raise UnsafeToRun(f"host {ctx.host_id} cannot read the checkpoint {fact.url} of {wf['id']} ({exc}); "
                          "nothing started") from None
    if (sha, size) != (fact.sha256, fact.size_bytes):
        raise UnsafeToRun(f"the checkpoint {fact.url} of {wf['id']} does not match what was recorded when it was "
                          f"written (sha256 {sha[:12]}… of {size} bytes, recorded {fact.sha256[:12]}… of "
                          f"{fact.size_bytes} bytes); nothing started")
    if is_local(fact.url):
        return str(local_path(fact.url)), fact.step
    local = Path(wf["checkpoint_dir"]) / Path(fact.url.rstrip("/")).name
    local.parent.mkdir(parents=True, exist_ok=True)
    fsspec.open(fact.url).fs.get_file(fact.url, str(local))
    if digest(str(local))[0] != fact.sha256:
        raise UnsafeToRun(f"the copy of {fact.url} fetched to {local} does not match its recorded sha256; "
                          "nothing started")
    return str(local), fact.step


def _start(ctx: CommandContext, workflow_id: str, device_ids: list[int], lane_id: int | None, *,
           checkpoint_id: int | None, resume_folder: str | None, timeout_s: float,
           share_bytes: int | None = None) -> dict[str, Any]:
    running = [p for p in find_job_processes(workflow_id, ctx.host_id) if alive(p)]
    if running:  # a re-sent command, or the previous agent started it before it died
        return {"pid": running[0].pid, "already_running": True, "connected": True}
    wf = workflow_spec(ctx, workflow_id)
    resume_from: str | None = None
    resume_step: int | None = None
    if checkpoint_id is not None:
        resume_from, resume_step = _verified_checkpoint(ctx, wf, int(checkpoint_id))
    elif resume_folder is not None:  # no recorded checkpoint: the newest the job left in its own folder, if any
        folder = Path(wf["checkpoint_dir"] or "")
        if wf["checkpoint_dir"] and Path(resume_folder).resolve() == folder.resolve() and folder.is_dir() and any(
                not p.name.startswith(".") for p in folder.iterdir()):
            resume_from = str(folder)
    with ctx.store.session() as session:
        env, cores = job_env(session, workflow_id, device_ids, lane_id, host_id=ctx.host_id,
                             resume_from=resume_from, resume_step=resume_step, share_bytes=share_bytes,
                             mps_dirs=ctx.settings.mps_dirs)
    log_path = log_path_for(ctx.settings, workflow_id)
    with open(log_path.parent.mkdir(parents=True, exist_ok=True) or log_path, "ab") as f:
        f.write(f"{START_MARK} at {time.ctime()} on devices {device_ids} lane {lane_id}"
                f"{' resuming from ' + resume_from if resume_from else ''}\n".encode())
    popen = spawn_job(wf["command"], wf["cwd"], env, cores=cores, log_path=log_path, detach=True)
    REAPER.add(popen, workflow_id)
    result = _confirm(ctx, popen, workflow_id, log_path, timeout_s)
    return {**result, "resume_from": resume_from, "resume_step": resume_step}


def _confirm(ctx: CommandContext, popen: Any, workflow_id: str, log_path: Path, timeout_s: float) -> dict[str, Any]:
    """Wait until the job says hello on the SDK socket or has run `timeout_s`: an exit before that is a failure.

    A job that said hello and then ended (its goodbye heard, however soon after: between two polls here) has
    started; how it ended is the reaper's to record, as for any job that ends later."""
    handlers = ctx.sdk
    # a job without the SDK never says hello: surviving `timeout_s` (a few seconds) is all we can check then
    deadline = time.monotonic() + timeout_s
    connected = False
    while time.monotonic() < deadline:
        if popen.poll() is not None:
            if handlers is not None and handlers.said_goodbye(workflow_id, popen.pid):
                connected = True
                break
            tail = _tail(log_path)
            raise RuntimeError(f"{workflow_id} exited at once with code {popen.returncode}: {tail}")
        if handlers is not None and any(j.get("workflow") == workflow_id and j.get("pid") == popen.pid
                                        for j in handlers.jobs()):
            connected = True
            break
        time.sleep(0.05)
    return {"pid": popen.pid, "log": str(log_path), "connected": connected}


def _tail(path: Path, n: int = 600) -> str:
    try:
        return path.read_bytes()[-n:].decode(errors="replace").strip()
    except OSError:
        return "(no log)"


def handle_launch(payload: dict[str, Any], ctx: CommandContext) -> dict[str, Any]:
    """Start a registered managed job where `fleetlens run --detach` placed it; its placement gets the pid."""
    workflow_id = str(payload["workflow_id"])
    result = _start(ctx, workflow_id, [int(d) for d in payload["device_ids"]], payload.get("lane_id"),
                    checkpoint_id=None, resume_folder=None,
                    timeout_s=float(payload.get("timeout_s", DEFAULT_START_TIMEOUT_S)))
    mark_started(ctx.store, workflow_id, [int(p) for p in payload.get("placement_ids", [])], result["pid"])
    return result


def handle_relaunch(payload: dict[str, Any], ctx: CommandContext) -> dict[str, Any]:
    """Start the workflow's signed relaunch spec on a device / lane, resuming from its recorded checkpoint (whose
    sha256 this host checks first) or, with none recorded, from the newest one in its own folder."""
    checkpoint_id = payload.get("checkpoint_id")
    return _start(ctx, str(payload["workflow_id"]), [int(payload["device_id"])], payload.get("lane_id"),
                  checkpoint_id=None if checkpoint_id is None else int(checkpoint_id),
                  resume_folder=payload.get("resume_folder"),
                  timeout_s=float(payload.get("timeout_s", DEFAULT_START_TIMEOUT_S)),
                  share_bytes=_int_or_none(payload.get("share_bytes")))


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)

