"""The agents' command queue: enqueue a signed command for a host, claim a host's pending ones, record the outcome."""

from __future__ import annotations

import secrets
import time
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.orm import Session

from store.db import Store
from store.errors import InvalidInput, NotFound
from store.models import Command
from store.signing import sign

STATUSES = ("pending", "running", "done", "failed", "refused")
FINAL_STATUSES = ("done", "failed", "refused")


def enqueue_command(
    session: Session,
    host_id: str,
    kind: str,
    payload: dict[str, Any] | None,
    ttl: float,
    action_id: int | None = None,
    *,
    secret: bytes,
    now: float | None = None,
) -> Command:
    """Queue a command for `host_id`'s agent, signed under the fleet secret; it expires `ttl` seconds from now.

    Callers pass the fleet's settings down: `ttl` (FLEETLENS_COMMAND_TTL_S, or a step's own deadline) and `secret`
    (Settings.secret_bytes()).
    """
    if not host_id or not kind:
        raise InvalidInput("a command needs a host id and a kind")
    if len(kind) > 32:
        raise InvalidInput(f"command kind {kind!r} is longer than 32 characters")
    payload = {} if payload is None else payload
    if not isinstance(payload, dict):
        raise InvalidInput(f"a command's payload must be a JSON object, not {type(payload).__name__}")
    if ttl <= 0:
        raise InvalidInput(f"a command's ttl must be positive seconds, not {ttl}")
    now = time.time() if now is None else now
    nonce = secrets.token_hex(16)
    expires_at = now + ttl
    try:
        signature = sign(secret, kind, host_id, payload, nonce, expires_at)
    except TypeError as exc:
        raise InvalidInput(f"a command's payload must be JSON: {exc}") from None
    command = Command(
        host_id=host_id, kind=kind, payload=payload, nonce=nonce, issued_at=now, expires_at=expires_at,
        signature=signature, action_id=action_id, status="pending",
    )
    session.add(command)
    session.flush()
    return command


def has_pending(store: Store, host_id: str) -> bool:
    """Whether any command waits for `host_id`: one indexed Core query, cheap enough to ask every second."""
    query = select(Command.id).where(Command.host_id == host_id, Command.status == "pending").limit(1)
    try:
        with store.engine.connect() as conn:
            return conn.execute(query).first() is not None
    except (OperationalError, DBAPIError) as exc:
        raise store.unavailable(exc) from None


def claim_pending(session: Session, host_id: str, *, now: float | None = None, limit: int = 50) -> list[Command]:
    """The host's pending commands, oldest first, marked 'running' so no other claimer takes them.

    On PostgreSQL the rows are locked with SKIP LOCKED, so two claimers never get the same command.
    Verification (signature, expiry, replay) is the agent's job: it runs only what it has checked.
    """
    now = time.time() if now is None else now
    query = (
        select(Command)
        .where(Command.host_id == host_id, Command.status == "pending")
        .order_by(Command.issued_at, Command.id)
        .limit(limit)
    )
    if session.get_bind().dialect.name == "postgresql":
        query = query.with_for_update(skip_locked=True)
    commands = list(session.scalars(query))
    for command in commands:
        command.status, command.claimed_at = "running", now
    session.flush()
    return commands


def finish(
    session: Session, command_id: int, status: str, result: dict[str, Any] | None = None, *, now: float | None = None
) -> None:
    """Record a command's outcome: done, failed or refused, with a JSON result (the reason when refused)."""
    if status not in FINAL_STATUSES:
        raise InvalidInput(f"a command finishes as one of {', '.join(FINAL_STATUSES)}, not {status!r}")
    done = session.execute(
        update(Command)
        .where(Command.id == command_id)
        .values(status=status, result=result or {}, done_at=time.time() if now is None else now)
    )
    if done.rowcount == 0:
        raise NotFound(f"no command {command_id} in the store")


WITHDRAWN = "withdrawn"  # result.error of a command taken back before any agent claimed it


def withdraw_pending(session: Session, command_ids: list[int], reason: str, *, now: float | None = None) -> list[int]:
    """Take back the commands among `command_ids` that no agent has claimed yet: each finishes 'failed' with
    result {"error": "withdrawn: <reason>", "withdrawn": true}, so an agent that comes back never runs it. Returns
    the ids withdrawn; one an agent claimed meanwhile (PostgreSQL re-reads the row after a claimer's lock, SQLite
    writes one at a time) is left to its agent and not returned."""
    now = time.time() if now is None else now
    withdrawn = []
    for command_id in command_ids:
        done = session.execute(
            update(Command).where(Command.id == command_id, Command.status == "pending")
            .values(status="failed", result={"error": f"{WITHDRAWN}: {reason}", WITHDRAWN: True}, done_at=now)
            .execution_options(synchronize_session="fetch"))
        if done.rowcount:
            withdrawn.append(command_id)
    return withdrawn


def get_command(session: Session, command_id: int) -> Command:
    command = session.get(Command, command_id)
    if command is None:
        raise NotFound(f"no command {command_id} in the store")
    return command
