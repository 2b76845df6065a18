"""`fleetlens profile WORKFLOW --steps N`: ask a running job for an on-demand trace and wait for it to land."""

from __future__ import annotations

import getpass
import math
import time

import typer

from store import profiling
from store.db import Store
from store.errors import FleetlensError, InvalidInput
from ui.cli.app import app, console, err_console, open_store, settings

POLL_S = 0.25


class ProfileNotCaptured(FleetlensError):
    """The profile request failed, expired, or is not finished when the caller stopped waiting."""


@app.command()
def profile(
    workflow: str = typer.Argument(..., help="the workflow id (FLEETLENS_WORKFLOW of the job)"),
    steps: int = typer.Option(10, "--steps", help="how many training steps to trace"),
    timeout: float = typer.Option(300.0, "--timeout", help="seconds to wait for the trace"),
    no_wait: bool = typer.Option(False, "--no-wait", help="make the request and return at once"),
) -> None:
    """Trace the next N steps of a running job (torch.profiler, via its host's agent) and print the trace path."""
    if not 0 < timeout < math.inf:  # NaN too: its deadline never comes
        raise InvalidInput(f"--timeout must be a positive number of seconds, not {timeout:g}")
    s = settings()
    store = open_store()
    with store.session() as session:
        request = profiling.request_profile(
            session, workflow, steps, requested_by=_user(), ttl_s=max(s.profile_ttl_s, 0 if no_wait else timeout)
        )
        request_id = request.id
    try:  # from the moment the request is stored: a Ctrl-C withdraws it
        err_console.print(f"profile request #{request_id}: the next {steps} steps of {workflow}", highlight=False)
        if no_wait:
            console.print(str(request_id), highlight=False)
            return
        deadline = time.monotonic() + timeout
        while True:
            problem = None
            with store.session() as session:
                profiling.expire_stale(session, capture_timeout_s=s.profile_capture_timeout_s)
                request = profiling.get_request(session, request_id)
                status = request.status
                if status == profiling.DONE:
                    for trace in profiling.traces_for_request(session, request_id):
                        console.print(trace.path, highlight=False, soft_wrap=True)
                    return
                if status in (profiling.FAILED, profiling.EXPIRED):
                    problem = f"profile request #{request_id} {status}: {request.error}"
                elif time.monotonic() >= deadline:
                    if status == profiling.PENDING:
                        profiling.fail(
                            session, request_id, status=profiling.EXPIRED,
                            error=f"no job of workflow {workflow!r} asked an agent for work within {timeout:g} s; is "
                            "the job running with collector.job, and `fleetlens agent` running on its host?",
                        )
                        problem = f"profile request #{request_id} expired: {request.error}"
                    else:
                        problem = (
                            f"profile request #{request_id} is still being captured after {timeout:g} s (a job claimed "
                            "it but has not sent the trace yet); the trace is registered in the traces table when it "
                            "lands"
                        )
            if problem is not None:  # raised after the session committed what it changed
                raise ProfileNotCaptured(problem)
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        _withdraw(store, request_id)
        raise


def _withdraw(store: Store, request_id: int) -> None:
    """Ctrl-C while waiting: a request no job took up yet is withdrawn, so no job traces steps nobody waits for any
    more (one a job is capturing is left to land in the traces table)."""
    with store.session() as session:
        profiling.withdraw(session, request_id,
                           "withdrawn: `fleetlens profile` was interrupted before a job took the request up")


def _user() -> str | None:
    try:
        return getpass.getuser()
    except Exception:  # no user name in some containers
        return None
