"""On-demand profiling in the store: profile requests and their life (pending, capturing, done, failed, expired),
and the traces table that captured traces are registered in.

A request is made for a workflow (`fleetlens profile`, or a periodic schedule); the agent serving that
workflow's job claims it when the job polls, the job captures the next N steps, and the agent registers the
trace and completes the request. A request nobody picks up expires, and one claimed but never finished fails,
each with a reason a person can act on.
"""

from __future__ import annotations

import time
from pathlib import Path

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from store.errors import InvalidInput, NotFound
from store.models import ProfileRequest, Trace
from store.workflows import get_workflow

PENDING, CAPTURING, DONE, FAILED, EXPIRED = "pending", "capturing", "done", "failed", "expired"
OPEN_STATES = (PENDING, CAPTURING)
REASONS = ("on_demand", "periodic")
MAX_STEPS = 10_000  # a trace of more steps than this would not fit in memory on the job's side


def request_profile(
    session: Session,
    workflow_id: str,
    steps: int,
    reason: str = "on_demand",
    requested_by: str | None = None,
    *,
    ttl_s: float | None = 600.0,
    now: float | None = None,
) -> ProfileRequest:
    """Ask the jobs of `workflow_id` to trace their next `steps` steps. NotFound for an unknown workflow."""
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS:
        raise InvalidInput(f"a profile needs between 1 and {MAX_STEPS} steps, not {steps!r}")
    if reason not in REASONS:
        raise InvalidInput(f"profile reason {reason!r} is not one of {', '.join(REASONS)}")
    get_workflow(session, workflow_id)
    now = time.time() if now is None else now
    request = ProfileRequest(
        workflow_id=workflow_id, steps=steps, reason=reason, requested_by=requested_by, requested_at=now,
        expires_at=None if ttl_s is None else now + ttl_s, status=PENDING,
    )
    session.add(request)
    session.flush()
    return request


def get_request(session: Session, request_id: int) -> ProfileRequest:
    request = session.get(ProfileRequest, request_id)
    if request is None:
        raise NotFound(f"no profile request #{request_id}; `fleetlens profile WORKFLOW` makes one")
    return request


def expire_stale(session: Session, *, capture_timeout_s: float = 900.0, now: float | None = None) -> int:
    """Expire pending requests past their deadline and fail captures that never finished; returns how many."""
    now = time.time() if now is None else now
    expired = session.execute(
        update(ProfileRequest)
        .where(ProfileRequest.status == PENDING, ProfileRequest.expires_at < now)
        .values(
            status=EXPIRED, completed_at=now,
            error="no job of this workflow polled an agent before the request expired; is the job running with "
            "collector.job, and is `fleetlens agent` running on its host?",
        )
    ).rowcount
    failed = session.execute(
        update(ProfileRequest)
        .where(ProfileRequest.status == CAPTURING, ProfileRequest.claimed_at < now - capture_timeout_s)
        .values(
            status=FAILED, completed_at=now,
            error=f"the job claimed the request but sent no trace within {capture_timeout_s:g} s "
            "(it may have ended, hung or been killed while capturing)",
        )
    ).rowcount
    return (expired or 0) + (failed or 0)


def open_requests(session: Session, workflow_id: str, *, now: float | None = None) -> list[ProfileRequest]:
    """The workflow's pending and capturing requests, oldest first (stale pending ones are left out)."""
    now = time.time() if now is None else now
    rows = session.scalars(
        select(ProfileRequest)
        .where(ProfileRequest.workflow_id == workflow_id, ProfileRequest.status.in_(OPEN_STATES))
        .order_by(ProfileRequest.requested_at, ProfileRequest.id)
    )
    return [r for r in rows if r.status == CAPTURING or r.expires_at is None or r.expires_at >= now]


def pending_request(session: Session, workflow_id: str, *, now: float | None = None) -> ProfileRequest | None:
    """The workflow's oldest request still waiting for a job, or None."""
    for request in open_requests(session, workflow_id, now=now):
        if request.status == PENDING:
            return request
    return None


def claim(session: Session, request_id: int, *, now: float | None = None) -> ProfileRequest | None:
    """Mark a pending request as being captured; None if it is no longer pending (claimed, expired, done)."""
    now = time.time() if now is None else now
    # one UPDATE ... WHERE status = pending, so two agents never both claim it
    claimed = session.execute(
        update(ProfileRequest)
        .where(ProfileRequest.id == request_id, ProfileRequest.status == PENDING)
        .values(status=CAPTURING, claimed_at=now)
        .execution_options(synchronize_session=False)
    ).rowcount
    if not claimed:
        return None
    request = get_request(session, request_id)
    session.refresh(request)
    return request


def complete(session: Session, request_id: int, *, now: float | None = None) -> ProfileRequest:
    """The trace is in: mark the request done (idempotent; a request already failed or expired stays so)."""
    request = get_request(session, request_id)
    if request.status in OPEN_STATES:
        request.status, request.completed_at, request.error = DONE, time.time() if now is None else now, None
        session.flush()
    return request


def fail(
    session: Session, request_id: int, error: str, *, status: str = FAILED, now: float | None = None
) -> ProfileRequest:
    """End an open request as failed (or expired) with the reason; a request already ended is left as it is."""
    if status not in (FAILED, EXPIRED):
        raise InvalidInput(f"a profile request ends as failed or expired, not {status!r}")
    request = get_request(session, request_id)
    if request.status in OPEN_STATES:
        request.status, request.error = status, error
        request.completed_at = time.time() if now is None else now
        session.flush()
    return request


def withdraw(session: Session, request_id: int, error: str, *, now: float | None = None) -> bool:
    """Expire a request no job has taken up yet, with the reason; False if it is no longer pending (a job claimed it
    first: its trace still lands). One UPDATE ... WHERE status = pending, so it never undoes a claim."""
    now = time.time() if now is None else now
    return bool(session.execute(
        update(ProfileRequest)
        .where(ProfileRequest.id == request_id, ProfileRequest.status == PENDING)
        .values(status=EXPIRED, error=error, completed_at=now)
        .execution_options(synchronize_session=False)
    ).rowcount)


def register_trace(
    session: Session,
    workflow_id: str | None,
    path: str | Path,
    rank: int = 0,
    request_id: int | None = None,
    *,
    host_id: str | None = None,
    steps: int | None = None,
    size_bytes: int | None = None,
    now: float | None = None,
) -> Trace:
    """Record a trace file for the analyzer. The file must exist; its size is read if not given."""
    path = Path(path)
    if not path.is_file():
        raise InvalidInput(f"trace file {path} does not exist or is not a file")
    if workflow_id is not None:
        get_workflow(session, workflow_id)
    if request_id is not None:
        get_request(session, request_id)
    trace = Trace(
        workflow_id=workflow_id, profile_request_id=request_id, host_id=host_id, rank=rank, path=str(path),
        size_bytes=path.stat().st_size if size_bytes is None else size_bytes, steps=steps,
        created_at=time.time() if now is None else now, status="registered",
    )
    session.add(trace)
    session.flush()
    return trace


def traces_for_request(session: Session, request_id: int) -> list[Trace]:
    return list(
        session.scalars(select(Trace).where(Trace.profile_request_id == request_id).order_by(Trace.rank, Trace.id))
    )
