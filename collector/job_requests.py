"""What a job (collector.job.Job) does when the agent's reply to a poll asks for it: save a checkpoint between steps
(the job's `checkpoint` callback, into the folder the request names) or trace the next N steps (collector.job_capture),
and tell the agent how that went. A capture writes its trace from a thread of its own; the training loop sends the
result at its next flush."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from collector import protocol as p
from collector.job_capture import CaptureOwner, TraceCapture, trace_folder
from store.paths import path_component
from store.settings import Settings

log = logging.getLogger(__name__)


class RequestsOwner(CaptureOwner, Protocol):
    """What the requests need of the job they are made of (collector.job.Job)."""

    settings: Settings
    checkpoints: list[dict[str, Any]]
    traces: list[str]
    _checkpoint_fn: Callable[[str], Any] | None
    _step: int
    _capture: TraceCapture | None
    _finished_captures: list[dict[str, Any]]

    def _msg(self, op: str, **fields: Any) -> dict[str, Any]: ...

    def _send(self, message: dict[str, Any], *, wait_forever: bool = False) -> dict[str, Any] | None: ...

    def _link_ready(self) -> bool: ...


def act(job: RequestsOwner, reply: dict[str, Any]) -> None:
    """Carry out what the agent's reply asks for: a checkpoint, a profile, both or neither."""
    if isinstance(reply.get("checkpoint"), dict):
        checkpoint_on_request(job, reply["checkpoint"])
    if isinstance(reply.get("profile"), dict):
        start_capture(job, reply["profile"])


# ---- checkpoints -----------------------------------------------------------------------------------------------


def checkpoint_on_request(job: RequestsOwner, request: dict[str, Any]) -> None:
    request_id = request.get("request_id")
    directory = request.get("directory") or str(
        job.settings.checkpoint_dir / path_component(job.workflow_id))
    if job._checkpoint_fn is None:
        job._send(job._msg(p.CHECKPOINT_FAILED, request_id=request_id, step=job._step,
                           error="this job passed no checkpoint callback to collector.job"))
        return
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
        path = job._checkpoint_fn(str(directory))
        path = str(path if path is not None else directory)
    except Exception as exc:
        log.warning("checkpoint into %s failed: %s", directory, exc)
        job._send(job._msg(p.CHECKPOINT_FAILED, request_id=request_id, step=job._step,
                           error=f"{type(exc).__name__}: {exc}"))
        return
    job.checkpoints.append({"request_id": request_id, "path": path, "step": job._step})
    job._send(job._msg(p.CHECKPOINT_DONE, request_id=request_id, path=path, step=job._step))


# ---- on-demand profiling ---------------------------------------------------------------------------------------


def start_capture(job: RequestsOwner, request: dict[str, Any]) -> None:
    request_id, steps = int(request["request_id"]), int(request["steps"])
    if job._capture is not None:
        job._send(job._msg(p.PROFILE_FAILED, request_id=request_id,
                           error=f"already capturing request #{job._capture.request_id}"))
        return
    try:
        folder = trace_folder(job.settings.trace_dir, job.workflow_id, request.get("trace_dir"), request_id)
        job._capture = TraceCapture(job, request_id, steps, folder)
    except Exception as exc:
        log.warning("cannot start profiling: %s", exc)
        job._send(job._msg(p.PROFILE_FAILED, request_id=request_id, error=f"{type(exc).__name__}: {exc}"))


def capture_step(job: RequestsOwner) -> None:
    """A step of the capture under way is done (the capture finishes after its last)."""
    capture = job._capture
    assert capture is not None
    capture.step()
    if capture.done:
        capture.finish()
        job._capture = None


def send_finished_captures(job: RequestsOwner) -> None:
    """Tell the agent of the captures written since the last time, while it listens."""
    while job._finished_captures and job._link_ready():
        result = job._finished_captures[0]
        if result.get("path"):
            job.traces.append(result["path"])
            sent = job._send(job._msg(p.PROFILE_DONE, **result))
        else:
            sent = job._send(job._msg(p.PROFILE_FAILED, request_id=result["request_id"],
                                      error=result["error"]))
        if sent is None:
            return
        job._finished_captures.pop(0)
