"""Runs the signed commands addressed to this host: verify (signature, expiry, replay), dispatch by kind, record.

Handlers are registered by kind (`register_handler`): the agent registers the managed jobs' command kinds
(collector.job_commands) when it starts, so the runner itself knows only `ping`. A command that is unsigned,
tampered, replayed, expired or of an unknown kind is refused: its row gets status 'refused' with the reason, the
refusal is logged, and it never runs.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from collector.sdk_handlers import LaneGate, SdkHandlers
from store.commands import claim_pending, finish, has_pending
from store.db import Store
from store.errors import DatabaseUnavailable, UnsafeToRun
from store.models import Command
from store.settings import Settings
from store.signing import verify

log = logging.getLogger(__name__)


@dataclass
class CommandContext:
    """What a handler gets besides its payload."""

    command_id: int
    kind: str
    host_id: str
    action_id: int | None
    store: Store
    settings: Settings
    agent: Any = None  # the running collector.agent.Agent, when there is one
    extra: dict[str, Any] = field(default_factory=dict)
    sdk: SdkHandlers | None = None  # the agent's SDK socket handlers (None: it serves no socket)
    gate: LaneGate | None = None  # the agent's lane gate


HandlerFn = Callable[[dict[str, Any], CommandContext], dict[str, Any] | None]

def _ping(payload: dict[str, Any], ctx: CommandContext) -> dict[str, Any]:
    """Harmless: proves the command path end to end."""
    return {"pong": True, "host_id": ctx.host_id, "echo": payload.get("echo"), "ts": time.time()}


_HANDLERS: dict[str, HandlerFn] = {"ping": _ping}  # the managed jobs' kinds are the agent's to register
_HANDLERS_LOCK = threading.Lock()


def register_handler(kind: str, fn: HandlerFn, *, replace: bool = True) -> None:
    """Run `fn(payload, ctx) -> result dict | None` for commands of `kind`; its result is stored on the row.

    A handler that raises marks the command 'failed' with the error as its result.
    """
    if not kind or len(kind) > 32:
        raise ValueError(f"a command kind is 1-32 characters, not {kind!r}")
    with _HANDLERS_LOCK:
        if not replace and kind in _HANDLERS:
            raise ValueError(f"a handler for command kind {kind!r} is already registered")
        _HANDLERS[kind] = fn


def unregister_handler(kind: str) -> None:
    with _HANDLERS_LOCK:
        _HANDLERS.pop(kind, None)


def registered_kinds() -> list[str]:
    with _HANDLERS_LOCK:
        return sorted(_HANDLERS)


def _handler(kind: str) -> HandlerFn | None:
    with _HANDLERS_LOCK:
        return _HANDLERS.get(kind)




class NonceLedger:
    """The nonces this host has accepted, on disk, so a replayed command is refused even after a restart.

    A nonce is kept until its command expires; after that the expiry check refuses the command anyway.
    """

    def __init__(self, path: Path, *, now: float | None = None) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._seen: dict[str, float] = {}
        now = time.time() if now is None else now
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    entry = json.loads(line)
                    self._seen[str(entry["nonce"])] = float(entry["expires_at"])
                except (ValueError, KeyError, TypeError):
                    continue  # a torn last line from a crash: that command was never run (recorded first)
            live = {n: e for n, e in self._seen.items() if e >= now}
            if len(live) != len(self._seen):
                self._seen = live
                self._rewrite()

    def _rewrite(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            for nonce, expires_at in self._seen.items():
                f.write(json.dumps({"nonce": nonce, "expires_at": expires_at}) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def __contains__(self, nonce: str) -> bool:
        with self._lock:
            return nonce in self._seen

    def add(self, nonce: str, expires_at: float) -> None:
        """Record `nonce` durably before its command runs, so a crash mid-run cannot lead to running it twice."""
        with self._lock:
            self._seen[nonce] = expires_at
            with open(self.path, "a") as f:
                f.write(json.dumps({"nonce": nonce, "expires_at": expires_at}) + "\n")
                f.flush()
                os.fsync(f.fileno())


@dataclass(frozen=True)
class Outcome:
    command_id: int
    kind: str
    status: str  # done | failed | refused
    result: dict[str, Any]


def ledger_path(settings: Settings, host_id: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", host_id)
    return settings.home / f"agent-{safe}.nonces"


class CommandRunner:
    """Claims this host's pending commands, refuses what fails verification, and runs the rest in order."""

    def __init__(
        self,
        store: Store,
        settings: Settings,
        host_id: str,
        *,
        secret: bytes | None = None,
        ledger: NonceLedger | None = None,
        agent: Any = None,
        sdk: SdkHandlers | None = None,
        gate: LaneGate | None = None,
    ) -> None:
        self.store = store
        self.settings = settings
        self.host_id = host_id
        self.secret = settings.secret_bytes() if secret is None else secret
        self.ledger = ledger or NonceLedger(ledger_path(settings, host_id))
        self.agent = agent
        self.sdk, self.gate = sdk, gate
        # outcomes the database could not take when they were reached (it went away meanwhile), oldest first: each is
        # recorded when it is back (`report_unreported`); collector.job_fence stops a start still unreported when its
        # command expires, since the enforcer takes it for lost from then on
        self.unreported: list[Unreported] = []
        self._unreported_lock = threading.Lock()

    def refusal(self, command: Command, now: float | None = None) -> str | None:
        """Why `command` must not run, or None when it may."""
        now = time.time() if now is None else now
        if not command.signature:
            return "unsigned: the command carries no signature"
        if command.host_id != self.host_id:
            return f"addressed to host {command.host_id!r}, not this host {self.host_id!r}"
        if not verify(self.secret, command.signature, command.kind, command.host_id, command.payload or {},
                      command.nonce, command.expires_at):
            return "tampered: the signature does not match the command (or was made with another FLEETLENS_SECRET)"
        if command.expires_at < now:
            return f"expired: its expiry passed {now - command.expires_at:.1f} s ago"
        if command.nonce in self.ledger:
            return f"replayed: nonce {command.nonce} was already used"
        if _handler(command.kind) is None:
            return f"unknown kind {command.kind!r}: this agent runs {', '.join(registered_kinds())}"
        return None

    def recover(self) -> int:
        """Commands left 'running' by a previous agent that died are failed, never re-run; returns how many."""
        with self.store.session() as session:
            stale = session.query(Command).filter(Command.host_id == self.host_id, Command.status == "running").all()
            for command in stale:
                finish(session, command.id, "failed", {"error": "the agent stopped while running it"})
        return len(stale)

    def outcomes_unreported(self) -> list[Unreported]:
        """The outcomes still waiting for the database (the entries themselves: a fence may change one)."""
        with self._unreported_lock:
            return list(self.unreported)

    def report_unreported(self) -> int:
        """Record the outcomes the database could not take before; returns how many are recorded now. Raises
        DatabaseUnavailable when it is still away (what is left is kept)."""
        with self._unreported_lock:
            left, self.unreported = self.unreported, []
        recorded = 0
        try:
            while left:
                u = left[0]
                with self.store.session() as session:
                    finish(session, u.command.id, u.status, u.result)
                left.pop(0)
                recorded += 1
        finally:
            with self._unreported_lock:
                self.unreported[:0] = left
        return recorded

    def poll(self) -> list[Outcome]:
        """Claim and handle every pending command for this host; returns what happened to each."""
        if self.unreported:
            self.report_unreported()
        if not has_pending(self.store, self.host_id):
            return []
        with self.store.session() as session:
            claimed = [_Snapshot.of(c) for c in claim_pending(session, self.host_id)]
        return [self._handle(c) for c in claimed]

    def _handle(self, command: _Snapshot) -> Outcome:
        reason = self.refusal(command)  # type: ignore[arg-type]
        if reason is not None:
            log.warning("refused command %d (%s) for host %s: %s", command.id, command.kind, command.host_id, reason)
            return self._finish(command, "refused", {"reason": reason})
        self.ledger.add(command.nonce, command.expires_at)
        fn = _handler(command.kind)
        ctx = CommandContext(command.id, command.kind, self.host_id, command.action_id, self.store, self.settings,
                             self.agent, sdk=self.sdk, gate=self.gate)
        try:
            result = fn(dict(command.payload or {}), ctx) if fn else None
        except UnsafeToRun as exc:
            log.error("command %d (%s) refused to run: %s", command.id, command.kind, exc)
            return self._finish(command, "failed", {"error": f"{type(exc).__name__}: {exc}", "unsafe": True})
        except Exception as exc:
            log.exception("command %d (%s) failed", command.id, command.kind)
            return self._finish(command, "failed", {"error": f"{type(exc).__name__}: {exc}"})
        log.info("ran command %d (%s)", command.id, command.kind)
        return self._finish(command, "done", result or {})

    def _finish(self, command: _Snapshot, status: str, result: dict[str, Any]) -> Outcome:
        try:
            with self.store.session() as session:
                finish(session, command.id, status, result)
        except DatabaseUnavailable:
            with self._unreported_lock:
                self.unreported.append(Unreported(command, status, result))
            raise
        return Outcome(command.id, command.kind, status, result)


@dataclass
class Unreported:
    """A command's outcome the database could not take yet."""

    command: _Snapshot
    status: str
    result: dict[str, Any]


@dataclass(frozen=True)
class _Snapshot:
    """A claimed command's fields, read inside the claiming session (rows are not used after it closes)."""

    id: int
    host_id: str
    kind: str
    payload: dict[str, Any]
    nonce: str
    expires_at: float
    signature: str | None
    action_id: int | None

    @classmethod
    def of(cls, c: Command) -> _Snapshot:
        return cls(c.id, c.host_id, c.kind, dict(c.payload or {}), c.nonce, c.expires_at, c.signature, c.action_id)
