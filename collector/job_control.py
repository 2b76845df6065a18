"""The agent's `checkpoint` and `stop` commands: ask a running managed job to save a checkpoint (through the SDK
socket) and record it, or stop it (SIGTERM, SIGKILL after a grace period). Both are idempotent: the enforcer re-sends
a command whose outcome it never saw, and stopping a job that is gone says so."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import fsspec
import psutil

from collector.command_runner import CommandContext
from collector.job_reaper import GONE, REAPER, alive
from collector.job_start import workflow_spec
from collector.launch import find_job_processes
from store.checkpoints import digest, is_local, record_checkpoint
from store.errors import InvalidInput

DEFAULT_STOP_GRACE_S = 10.0


def handle_checkpoint(payload: dict[str, Any], ctx: CommandContext) -> dict[str, Any]:
    """Ask the running job (through the SDK socket) to checkpoint, and wait for its answer.

    Result `status`: done (path, step), failed (the job's error), timeout (no answer in time; the request is
    withdrawn and the job goes on), gone (the job is not running, or died before answering)."""
    workflow_id, request_id = str(payload["workflow_id"]), str(payload["request_id"])
    timeout_s = float(payload.get("timeout_s", ctx.settings.checkpoint_timeout_s))
    handlers = ctx.sdk
    if handlers is None:
        raise InvalidInput("this agent serves no job SDK socket, so it cannot ask a job to checkpoint")
    procs = [p for p in find_job_processes(workflow_id, ctx.host_id) if alive(p)]
    if not procs:
        return {"status": "gone", "error": f"{workflow_id} is not running on {ctx.host_id}"}
    handlers.request_checkpoint(workflow_id, request_id, payload["directory"])
    deadline = time.monotonic() + timeout_s
    next_check = 0.0
    while True:
        result = handlers.checkpoint_result(request_id)
        if result is not None:
            out = {"status": result["status"], "path": result.get("path"), "step": result.get("step"),
                   "error": result.get("error"), "pids": [p.pid for p in procs]}
            handlers.cancel_checkpoint(request_id)
            if out["status"] == "done" and out["path"]:
                out.update(_record(ctx, workflow_id, str(out["path"]), out["step"]))
            return out
        now = time.monotonic()
        if now >= next_check:
            next_check = now + 0.5
            if not any(alive(p) for p in procs):
                handlers.cancel_checkpoint(request_id)
                return {"status": "gone", "error": f"{workflow_id} exited before answering the checkpoint request"}
        if now >= deadline:
            handlers.cancel_checkpoint(request_id)
            delivered = handlers.checkpoint_delivered(request_id) if hasattr(handlers, "checkpoint_delivered") else None
            return {"status": "timeout", "delivered": delivered, "error": (
                f"{workflow_id} did not answer the checkpoint request within {timeout_s:.0f} s "
                f"({'it was told, but never saved' if delivered else 'it never polled the agent: no fleetlens SDK?'})"
            )}
        time.sleep(0.02)


def _record(ctx: CommandContext, workflow_id: str, path: str, step: int | None) -> dict[str, Any]:
    """The checkpoint the job just wrote becomes a fact in the store: published to the job's checkpoint location
    (an object store gets a copy), read back through fsspec for its size and sha256, and recorded."""
    wf = workflow_spec(ctx, workflow_id, verify_spec=False)
    try:
        url = str(Path(path).resolve())
        if wf["checkpoint_url"] and not is_local(wf["checkpoint_url"]):
            url = f"{wf['checkpoint_url'].rstrip('/')}/{Path(path).name}"
            fsspec.open(url).fs.put_file(path, url)
        sha, size = digest(url)
    except (OSError, ImportError, ValueError) as exc:
        return {"status": "failed", "error": f"the checkpoint {path} could not be published and read back ({exc})"}
    with ctx.store.session() as session:
        fact = record_checkpoint(session, workflow_id, host_id=ctx.host_id, url=url, step=step, sha256=sha,
                                 size_bytes=size, action_id=ctx.action_id)
    return {"checkpoint_id": fact.id, "url": url, "sha256": sha, "size_bytes": size}


def handle_stop(payload: dict[str, Any], ctx: CommandContext) -> dict[str, Any]:
    """SIGTERM the job (and its children), SIGKILL what is left after the grace period; not when the checkpoint the
    stop follows is older than `max_age_s` (the job trained on since), which the enforcer then takes again."""
    workflow_id = str(payload["workflow_id"])
    grace = float(payload.get("grace_s", DEFAULT_STOP_GRACE_S))
    procs = [p for p in find_job_processes(workflow_id, ctx.host_id) if alive(p)]
    if not procs:
        return {"already_stopped": True, "stopped": [], "killed": []}
    taken, max_age = payload.get("checkpoint_taken_at"), payload.get("max_age_s")
    if taken is not None and max_age is not None and time.time() - float(taken) > float(max_age):
        # the job trained on since its checkpoint: stopping it now would throw that work away
        return {"stale_checkpoint": True, "age_s": round(time.time() - float(taken), 1), "stopped": [], "killed": []}
    stopped, killed = stop_tree(procs, grace)
    if ctx.gate is not None:
        ctx.gate.release(workflow_id)  # a turn the stopped job held in its lane passes on at once
    return {"stopped": stopped, "killed": killed}


def stop_tree(procs: list[psutil.Process], grace: float) -> tuple[list[int], list[int]]:
    """SIGTERM these processes and their children, SIGKILL what is left after `grace` s; the reaper records their
    ends. Returns (the pids stopped, those of them killed)."""
    tree: list[psutil.Process] = []
    for p in procs:
        try:
            tree.extend([p, *p.children(recursive=True)])
        except GONE:
            continue
    for p in tree:
        try:
            p.terminate()
        except GONE:
            pass
    _, left = psutil.wait_procs(tree, timeout=grace)
    for p in left:
        try:
            p.kill()
        except GONE:
            pass
    psutil.wait_procs(left, timeout=5)
    REAPER.reap()
    return [p.pid for p in procs], [p.pid for p in left]

