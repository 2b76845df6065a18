"""Claims on traces: which run analyses a trace, how long its claim holds without news, how many times it was tried.

A run claims a trace by setting it 'analyzing' in one conditional UPDATE (compare-and-set on the row as it read it),
so of several runs that try at once (serve's two trace jobs, Airflow workers on other hosts) exactly one gets it.
While it analyses, a thread renews the claim every quarter of the lease (FLEETLENS_TRACE_CLAIM_TIMEOUT_S). A run
killed outright (the OOM killer, SIGKILL, its host going down) renews nothing more, and once its claim has gone a
whole lease without renewal the next run retakes the trace; a live run's claim is never taken. After
FLEETLENS_TRACE_MAX_ATTEMPTS claims that ended that way the trace is marked failed instead: it kills its analyser.

The claim lives in the trace's columns `claim_token` (the run's random token), `claimed_at` (when it last renewed
the claim) and `attempts` (how many claims the trace has had). A renewal and the final write only touch the row while
it still holds the run's token, so a run whose claim was retaken (it went a whole lease without renewing) writes
nothing. A claim without a time (left by a fleetlens before these columns) is retaken at once, as one attempt. A
claim's time is its renewer's clock and is judged by the next run's: the hosts' clocks must agree to well within the
lease (NTP does).

Two ends are not the trace's doing, and are told apart from a kill:
- a run stopped on purpose (Ctrl-C, SIGTERM, `serve` shutting down while a thread still analyses) gives its claim
  back: the row is put back as it was before the claim, so the stop is not counted as an attempt;
- a run alive but hung (a dead mount, a stuck read) renews for at most FLEETLENS_TRACE_ANALYSIS_MAX_S, then notes why
  on the row and lets the claim lapse: the trace is retried like a killed run's, and given up with that reason.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

from sqlalchemy import and_, or_, select, update
from sqlalchemy.orm import Session

from store.db import Store
from store.models import Trace
from store.settings import Settings

log = logging.getLogger(__name__)

ANALYZING = "analyzing"
# the claims this process is analysing under now (by token): what `release_held` gives back when the process stops
_HELD: dict[str, Claim] = {}
_HELD_LOCK = threading.Lock()

# what `claim` says when it did not take the trace: another live run holds it; it is analysed, failed or otherwise
# not among the statuses asked for; it was given up (marked failed: too many attempts); no such trace
Refusal = Literal["held", "finished", "gave_up", "missing"]


@dataclass(frozen=True)
class ClaimPolicy:
    """How long a claim holds without renewal, how many claims a trace gets, and how long a run renews one
    (FLEETLENS_TRACE_CLAIM_TIMEOUT_S, FLEETLENS_TRACE_MAX_ATTEMPTS, FLEETLENS_TRACE_ANALYSIS_MAX_S; the defaults are
    theirs)."""

    lease_s: float = 120.0
    max_attempts: int = 3
    max_analysis_s: float = 7200.0  # renewals stop after this long (FLEETLENS_TRACE_ANALYSIS_MAX_S)

    @classmethod
    def from_settings(cls, settings: Settings) -> ClaimPolicy:
        return cls(lease_s=settings.trace_claim_timeout_s, max_attempts=settings.trace_max_attempts,
                   max_analysis_s=settings.trace_analysis_max_s)

    @property
    def renew_every_s(self) -> float:
        return self.lease_s / 4

    def lapsed_before(self, now: float) -> float:
        """A claim last renewed before this time is a dead run's."""
        return now - self.lease_s


def takeable(statuses: Iterable[str], policy: ClaimPolicy, now: float | None = None):
    """A WHERE clause for traces `claim` would take: in one of `statuses`, or 'analyzing' under a lapsed claim."""
    before = policy.lapsed_before(time.time() if now is None else now)
    return or_(Trace.status.in_(list(statuses)),
               and_(Trace.status == ANALYZING, or_(Trace.claimed_at.is_(None), Trace.claimed_at < before)))


@dataclass
class Claim:
    """This run's hold on one trace; `kept()` renews it while the analysis runs, `finish()` writes the outcome,
    `release()` gives it back unfinished. `prior` is the row's claim columns as they were before this claim."""

    store: Store
    trace_id: int
    token: str
    attempt: int
    policy: ClaimPolicy
    path: str
    written_on: str | None  # the host that wrote the trace
    prior: dict = field(default_factory=dict)
    lost: threading.Event = field(default_factory=threading.Event)

    def renew(self, now: float | None = None) -> bool:
        """Push the claim's time forward; False (and `lost` set) once another run has retaken the trace."""
        with self.store.session() as session:
            held = session.execute(self._mine().values(claimed_at=time.time() if now is None else now)).rowcount == 1
        if not held:
            self.lost.set()
        return held

    @contextmanager
    def kept(self) -> Iterator[Claim]:
        """Renew the claim from a thread of its own while the block runs (the analysis holds the main thread), for
        at most the policy's `max_analysis_s`; while it runs, the claim is one `release_held` gives back."""
        stop = threading.Event()
        started = time.monotonic()

        def renewing() -> None:
            while not stop.wait(self.policy.renew_every_s):
                if time.monotonic() - started >= self.policy.max_analysis_s:
                    self._let_lapse(time.monotonic() - started)
                    return
                try:
                    if not self.renew():
                        log.warning("trace %s: another run retook it while this one analysed it (its claim went "
                                    "%.0f s without renewal); this run's result will be dropped", self.trace_id,
                                    self.policy.lease_s)
                        return
                except Exception as exc:  # the database away for a moment: the next renewal may get through
                    log.warning("trace %s: its claim could not be renewed: %s", self.trace_id, exc)

        thread = threading.Thread(target=renewing, name=f"trace-{self.trace_id}-claim", daemon=True)
        with _HELD_LOCK:
            _HELD[self.token] = self
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join()
            with _HELD_LOCK:
                _HELD.pop(self.token, None)

    def _let_lapse(self, ran_s: float) -> None:
        """Stop renewing a run that has gone on too long, and say so on the row (its error, read when the trace is
        given up); the claim then lapses and the next run retakes the trace."""
        why = (f"an analysis ran {ran_s:.0f} s without finishing and stopped renewing its claim "
               f"(FLEETLENS_TRACE_ANALYSIS_MAX_S = {self.policy.max_analysis_s:.0f})")
        log.error("trace %s (%s): %s; the next run takes it up again", self.trace_id, self.path, why)
        try:
            with self.store.session() as session:
                session.execute(self._mine().values(error=why))
        except Exception as exc:  # the note is lost, not the lapse: the claim still goes unrenewed
            log.warning("trace %s: could not note why its claim lapses: %s", self.trace_id, exc)

    def release(self) -> bool:
        """Give the claim back unfinished (the run was stopped on purpose): the row is put back as it was before it,
        so this claim is not counted as an attempt. False if this run no longer held it, or the database is away
        (then the claim lapses as a dead run's would, one attempt)."""
        try:
            with self.store.session() as session:
                held = session.execute(self._mine().values(**self.prior)).rowcount == 1
        except Exception as exc:
            log.warning("trace %s: its claim could not be given back: %s", self.trace_id, exc)
            return False
        if held:
            log.info("trace %s: this run stopped before the analysis ended; its claim is given back", self.trace_id)
        return held

    def finish(self, session: Session, **values) -> bool:
        """Write the analysis's outcome in `session` if this run still holds the claim; False when it does not (a
        run that went a whole lease without renewing lost the trace to another: its result is dropped)."""
        held = session.execute(self._mine().values(**values, claim_token=None, claimed_at=None)).rowcount == 1
        if not held:
            self.lost.set()
        return held

    def _mine(self):
        return update(Trace).where(Trace.id == self.trace_id, Trace.status == ANALYZING,
                                   Trace.claim_token == self.token)


def claim(store: Store, trace_id: int, policy: ClaimPolicy, *, statuses: Iterable[str] = ("registered",),
          host_id: str | None = None, now: float | None = None) -> Claim | Refusal:
    """Take the trace for this run if it is in one of `statuses`, or 'analyzing' under a lapsed claim (its run is
    dead); a trace whose lapsed claim was its last allowed attempt is marked failed instead ("gave_up")."""
    statuses = tuple(statuses)
    for _ in range(3):  # the row changed between the read and the update: judge it again as it is now
        with store.session() as session:
            row = session.execute(select(Trace.status, Trace.claim_token, Trace.claimed_at, Trace.attempts,
                                         Trace.path, Trace.host_id, Trace.error)
                              .where(Trace.id == trace_id)).one_or_none()
        if row is None:
            return "missing"
        at = time.time() if now is None else now
        if row.status == ANALYZING:
            if row.claimed_at is not None and row.claimed_at >= policy.lapsed_before(at):
                return "held"
            attempt = max(row.attempts, 1) + 1  # a claim an older fleetlens made counts as one
        elif row.status in statuses:
            attempt = 1
        else:
            return "finished"
        token = uuid.uuid4().hex
        if attempt > policy.max_attempts:
            values = {"status": "failed", "analyzed_at": at,
                      "error": _given_up(row.path, attempt - 1, policy, row.error if row.status == ANALYZING else None),
                      "claim_token": None, "claimed_at": None}
        else:
            values = {"status": ANALYZING, "error": None, "claim_token": token, "claimed_at": at,
                      "attempts": attempt}
        with store.session() as session:
            taken = session.execute(
                update(Trace).where(Trace.id == trace_id, Trace.status == row.status,
                                    Trace.claim_token.is_not_distinct_from(row.claim_token),
                                    Trace.claimed_at.is_not_distinct_from(row.claimed_at))
                .values(**values)).rowcount == 1
        if not taken:
            continue
        if values["status"] == "failed":
            log.error("trace %s (%s): %s", trace_id, row.path, values["error"])
            return "gave_up"
        log.info("trace %s: claimed for analysis (attempt %d of %d, host %s, pid %d)", trace_id, attempt,
                 policy.max_attempts, host_id or socket.gethostname(), os.getpid())
        prior = {"status": row.status, "error": row.error, "claim_token": row.claim_token, "claimed_at": row.claimed_at,
                 "attempts": row.attempts}
        return Claim(store, trace_id, token, attempt, policy, row.path, row.host_id, prior)
    return "held"


def release_held() -> int:
    """Give back every claim this process is analysing under (a stopping `serve` whose job threads did not end in
    time: they die with the process); how many were given back."""
    with _HELD_LOCK:
        held = list(_HELD.values())
    return sum(claimed.release() for claimed in held)


def claim_when_lapsed(store: Store, trace_id: int, policy: ClaimPolicy, *, statuses: Iterable[str] = ("registered",),
                      host_id: str | None = None) -> Claim | Refusal:
    """As `claim`, but a trace held by another run is watched for at most one lease: retaken when its claim lapses
    (the run is dead, as when Airflow retries the batch of a worker that was killed), left to its run as soon as the
    claim is renewed or finished (the run is alive)."""
    got = claim(store, trace_id, policy, statuses=statuses, host_id=host_id)
    if got != "held":
        return got
    seen = _claim_state(store, trace_id)
    poll_s = min(policy.renew_every_s, 5.0)
    deadline = time.monotonic() + policy.lease_s + poll_s
    while time.monotonic() < deadline:
        time.sleep(poll_s)
        now_seen = _claim_state(store, trace_id)
        if now_seen != seen:
            return "held" if now_seen[0] == ANALYZING else "finished"
        got = claim(store, trace_id, policy, statuses=statuses, host_id=host_id)
        if got != "held":
            return got
    return "held"


def _claim_state(store: Store, trace_id: int) -> tuple:
    with store.session() as session:
        row = session.execute(select(Trace.status, Trace.claim_token, Trace.claimed_at)
                              .where(Trace.id == trace_id)).one_or_none()
    return tuple(row) if row is not None else ("missing", None, None)


def _given_up(path: str, attempts: int, policy: ClaimPolicy, last_note: str | None = None) -> str:
    if last_note:  # the last run was alive but stopped renewing (FLEETLENS_TRACE_ANALYSIS_MAX_S), and said so
        return (f"{path}: its analysis was started {attempts} times and never finished; the last time, {last_note}. "
                f"A read that hangs (a traces folder on a mount that stopped answering) is the usual cause: check "
                f"that the analysing host reads the file, raise FLEETLENS_TRACE_ANALYSIS_MAX_S if the trace is only "
                f"big, then analyse it again (`fleetlens analyze PATH --store`)")
    return (f"{path}: its analysis was started {attempts} times and never finished: each time the analysing process "
            f"stopped without a word and renewed its claim no more (killed: running out of memory on a trace this "
            f"size is the usual cause). Give the analysing host more memory, or lower FLEETLENS_TRACE_MEMORY_MB so "
            f"that the reader refuses the trace with a reason, then analyse it again (`fleetlens analyze PATH "
            f"--store`); FLEETLENS_TRACE_MAX_ATTEMPTS (now {policy.max_attempts}) sets how many tries a trace gets")
