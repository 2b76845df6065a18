"""The agent's side of the SDK's serving mode: takes `serving` messages (per-application per-minute request
histograms), merges them in memory by workflow, application and minute, and writes them to the store on the
SDK writer's beat. A message with a bad record or SLO is refused whole, with the reason (the SDK raises it); what
the database cannot take yet stays merged in memory for the next try, so no request is lost or counted twice, and
what it refuses for another reason is tried again a few times and then given up, one workflow at a time, counted
in `unwritable` and logged, so it never stalls the other workflows.

A message may carry `sender` (a token unique to the SDK's recorder, e.g. a random UUID) and `seq` (its sequence
number, from 1, one more for each new message): the agent merges each (workflow, pid, sender)'s messages once, so
a message the agent merged but answered too late, sent again unchanged under the same `seq`, is acknowledged
without being counted twice (`duplicates`). Senders silent for SENDER_MEMORY_S are forgotten.

Raw requests (a message's `raw`, sent when the job enables them) are stored only when this agent's settings enable
them too; each workflow keeps its newest rows up to its cap (store.serving_raw), and the older rows they replace
are counted over the cap in the store, or here in `raw_not_enabled` when the agent keeps none."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from sqlalchemy.orm import Session

from store import batch_sizes as bs
from store import latency_sketch as ls
from store.db import Store
from store.errors import DatabaseUnavailable, InvalidInput
from store.models import Workflow
from store.models_serving import ServingApp
from store.serving import COUNT_FIELDS, SUM_FIELDS, check_minute, check_slo, declare_slo, merge_met, merge_minutes
from store.serving_raw import check_raw, write_raw
from store.settings import Settings
from store.workflows import upsert_workflow

log = logging.getLogger(__name__)

SENDER_MEMORY_S = 24 * 3600.0  # how long the last `seq` of a silent sender is remembered
WRITE_TRIES = 3  # writes in a row the store may refuse a workflow's data (not for being away) before it is given up


def _add(into: dict[str, Any], rec: dict[str, Any]) -> None:
    """Add one minute record of the same (workflow, application, minute) into another."""
    if into["slo"] != rec["slo"] and into["n"] and rec["n"]:
        into["met"] = None  # counted against two different SLOs: no exact count for either
    else:
        into["met"] = merge_met(into["met"], into["n"], rec["met"], rec["n"])
        into["slo"] = into["slo"] if into["n"] else rec["slo"]
    # computed on the counts before this record's: a part with requests but no batch-size classes clears them
    into["exec_by_batch"] = bs.merge_parts(into["exec_by_batch"], into["n"], rec["exec_by_batch"], rec["n"])
    for f in COUNT_FIELDS + SUM_FIELDS:
        into[f] += rec[f]
    into["devices"] = max(into["devices"], rec["devices"])
    ls.merge(into["exec_hist"], rec["exec_hist"])
    ls.merge(into["latency_hist"], rec["latency_hist"])


class ServingSink:
    def __init__(self, settings: Settings | None = None) -> None:
        self.raw_on = bool(settings and settings.serving_raw_requests)
        self.raw_cap = settings.serving_raw_max_rows if settings is not None else 0
        self._raw: dict[str, list[dict[str, Any]]] = {}
        self._raw_over: dict[str, int] = {}
        self.raw_not_enabled = 0  # raw requests jobs sent while this agent keeps none (counted, not stored)
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, str, float], dict[str, Any]] = {}
        self._slos: dict[tuple[str, str], float] = {}
        self.taken = 0  # requests (served + dropped) accepted from jobs
        self.written = 0  # of which in the store
        self.refused_messages = 0
        self._seqs: dict[tuple[str, Any, str], tuple[int, float]] = {}  # (wf, pid, sender) -> (last seq, when)
        self._next_forget = 0.0
        self.duplicates = 0  # messages merged already (same sender and seq), acknowledged and not counted again
        self._failures: dict[str, int] = {}  # workflow -> writes in a row the store refused (not for being away)
        self.unwritable = 0  # requests given up after WRITE_TRIES such refusals (logged with the reason)
        self.raw_unwritable = 0  # raw requests likewise

    def handle(self, msg: dict[str, Any]) -> bool:
        """Check and merge one message; InvalidInput (the whole message refused) when any record is bad. False when
        it was merged already (the same sender's `seq` again): acknowledged, not counted twice."""
        wf = msg["workflow"]
        try:
            sender, seq = msg.get("sender"), msg.get("seq")
            if (sender is None) != (seq is None):
                raise InvalidInput("serving: sender and seq go together")
            if sender is not None and (not isinstance(sender, str) or not 0 < len(sender) <= 128):
                raise InvalidInput(f"serving: sender {sender!r:.40} is not a string of 1 to 128 characters")
            if seq is not None and (isinstance(seq, bool) or not isinstance(seq, int) or seq < 1):
                raise InvalidInput(f"serving: seq={seq!r} is not a whole number >= 1")
            minutes = [check_minute(r) for r in msg["minutes"]]
            devices = msg.get("devices")
            devices = 1 if devices is None else devices
            if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
                raise InvalidInput(f"serving: devices={devices!r} is not a whole number >= 1")
            slos_in = msg.get("slos") or {}
            if not isinstance(slos_in, dict):
                raise InvalidInput("serving: slos must map applications to seconds")
            slos = dict(check_slo(a, s) for a, s in slos_in.items())
            raw_in = msg.get("raw") or []
            if not isinstance(raw_in, list):
                raise InvalidInput("serving: raw must be a list of requests")
            raw = [check_raw(r) for r in raw_in] if self.raw_on else []
            raw_over = msg.get("raw_over_cap") or 0
            if isinstance(raw_over, bool) or not isinstance(raw_over, int) or raw_over < 0:
                raise InvalidInput(f"serving: raw_over_cap={raw_over!r} is not a whole number >= 0")
        except (InvalidInput, TypeError, ValueError) as exc:
            with self._lock:
                self.refused_messages += 1
            raise InvalidInput(str(exc)) from None
        with self._lock:
            if sender is not None and not self._first_delivery((wf, msg.get("pid"), sender), seq):
                self.duplicates += 1
                return False
            for r in minutes:
                # devices: what the service holds in the minutes this message carries, not what it once held
                r["devices"], r["slo"] = devices, slos.get(r["app"])  # slo: the one `met` was counted against
                if r["slo"] is None and r["n"]:
                    r["met"] = None
                key = (wf, r["app"], r["minute"])
                cur = self._pending.get(key)
                if cur is None:
                    self._pending[key] = r
                else:
                    _add(cur, r)
                self.taken += r["n"] + r["dropped"]
            for app, s in slos.items():
                self._slos[(wf, app)] = s
            if not self.raw_on:
                self.raw_not_enabled += len(raw_in) + raw_over
            elif raw or raw_over:
                # what waits here is bounded by the cap too: only the newest `raw_cap` rows could stay stored
                waiting = self._raw.setdefault(wf, [])
                waiting.extend(raw)
                replaced = max(0, len(waiting) - self.raw_cap)
                del waiting[:replaced]
                self._raw_over[wf] = self._raw_over.get(wf, 0) + raw_over + replaced
        return True

    def _first_delivery(self, key: tuple[str, Any, str], seq: int) -> bool:
        """Whether `seq` is new from this sender (and remember it); called under the lock, so two deliveries of
        one message at once merge it once. A sender sends one message at a time: its sequence only grows."""
        now = time.monotonic()
        if now >= self._next_forget:
            self._next_forget = now + 60.0
            for k in [k for k, (_s, seen) in self._seqs.items() if now - seen > SENDER_MEMORY_S]:
                del self._seqs[k]
        last = self._seqs.get(key)
        if last is not None and seq <= last[0]:
            self._seqs[key] = (last[0], now)
            return False
        self._seqs[key] = (seq, now)
        return True

    def pending(self) -> int:
        with self._lock:
            return sum(r["n"] + r["dropped"] for r in self._pending.values())

    def write(self, store: Store) -> int:
        """Write what is pending; returns the requests written. Each workflow goes in its own transaction, in
        sorted order, so two agents writing the same ones lock their rows in the same order (store.rows). While
        the database is away (DatabaseUnavailable: unreachable, busy, another agent's transaction winning a
        deadlock) the workflow's data and every later one's stay for the next write, which raises. A workflow the
        store refuses for another reason is kept alone for the next write, and given up after WRITE_TRIES such
        refusals in a row (counted in `unwritable`, logged with the reason); the other workflows are written all
        the same, and no such refusal raises: one workflow's bad data never stalls the others, nor the agent's
        other writes."""
        with self._lock:
            if not self._pending and not self._raw and not self._raw_over:
                return 0
            pending, self._pending = self._pending, {}
            raw, self._raw = self._raw, {}
            raw_over, self._raw_over = self._raw_over, {}
            slos = dict(self._slos)
        by_wf: dict[str, list[dict[str, Any]]] = {}
        for (wf, _app, _minute), r in pending.items():
            by_wf.setdefault(wf, []).append(r)
        added = 0
        todo = sorted(set(by_wf) | set(raw) | set(raw_over))
        for i, wf in enumerate(todo):
            recs = by_wf.get(wf, [])
            try:
                with store.session() as session:
                    added += self._write_workflow(session, wf, recs, {a: s for (w, a), s in slos.items() if w == wf},
                                                  raw.get(wf, []), raw_over.get(wf, 0))
            except DatabaseUnavailable:
                left = set(todo[i:])
                self._keep({k: r for k, r in pending.items() if k[0] in left},
                           {w: rows for w, rows in raw.items() if w in left},
                           {w: n for w, n in raw_over.items() if w in left})
                raise
            except Exception as exc:  # the store refuses this workflow's data: kept for a few tries, then given up
                self._refused(wf, {k: r for k, r in pending.items() if k[0] == wf}, raw.get(wf, []),
                              raw_over.get(wf, 0), exc)
                continue
            with self._lock:
                self._failures.pop(wf, None)
                self.written += sum(r["n"] + r["dropped"] for r in recs)
        return added

    def _write_workflow(self, session: Session, wf: str, recs: list[dict[str, Any]], slos: dict[str, float],
                        raw: list[dict[str, Any]], raw_over: int) -> int:
        if session.get(Workflow, wf) is None:
            upsert_workflow(session, wf, id_source="env", labels={"kind": "serving"})
        added = 0
        if recs:
            for app, s in sorted(slos.items()):
                declare_slo(session, wf, app, s)  # fills in a missing SLO only: the operator's stays
            stored = {app: session.get(ServingApp, (wf, app)) for app in {r["app"] for r in recs}}
            judged = [r if r["slo"] == getattr(stored[r["app"]], "slo_s", None)
                      else {**r, "met": None}  # counted against another SLO than the one stored: no exact count
                      for r in recs]
            added = merge_minutes(session, wf, judged)
        if raw or raw_over:
            write_raw(session, wf, raw, self.raw_cap, over_cap=raw_over)
        return added

    def _refused(self, wf: str, pending: dict[tuple[str, str, float], dict[str, Any]], raw: list[dict[str, Any]],
                 raw_over: int, exc: Exception) -> None:
        """The store refused `wf`'s data for another reason than being away: kept for the next write (the reason may
        pass), given up after WRITE_TRIES refusals in a row: counted in `unwritable`, and logged with the reason."""
        with self._lock:
            tries = self._failures[wf] = self._failures.get(wf, 0) + 1
        requests = sum(r["n"] + r["dropped"] for r in pending.values())
        if tries < WRITE_TRIES:
            self._keep(pending, {wf: raw} if raw else {}, {wf: raw_over} if raw_over else {})
            log.warning("serving: the store refused workflow %r's %d requests (try %d of %d, kept for the next): %s",
                        wf, requests, tries, WRITE_TRIES, exc)
            return
        with self._lock:
            self._failures.pop(wf, None)
            self.unwritable += requests
            self.raw_unwritable += len(raw) + raw_over
            total = self.unwritable
        log.error("serving: the store refused workflow %r's %d requests and %d raw requests %d times, given up "
                  "(%d requests so far): %s", wf, requests, len(raw) + raw_over, tries, total, exc)

    def _keep(self, pending: dict[tuple[str, str, float], dict[str, Any]], raw: dict[str, list[dict[str, Any]]],
              raw_over: dict[str, int]) -> None:
        """Put back what was not written, merged with what came in meanwhile (nothing lost, nothing twice)."""
        with self._lock:
            for key, r in pending.items():
                cur = self._pending.get(key)
                if cur is None:
                    self._pending[key] = r
                else:
                    _add(cur, r)
            for wf, rows in raw.items():
                self._raw[wf] = rows + self._raw.get(wf, [])
            for wf, n in raw_over.items():
                self._raw_over[wf] = self._raw_over.get(wf, 0) + n
