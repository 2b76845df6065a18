"""The agent's side of the SDK's serving mode: takes `serving` messages (per-application per-minute request
histograms), merges them in memory by workflow, application and minute, and writes them to the store on the
SDK writer's beat. A message with a bad record is refused whole, with the reason (the SDK raises it); what the
database cannot take yet stays merged in memory for the next try, so no request is lost or counted twice.

Raw requests (a message's `raw`, sent when the job enables them) are stored only when this agent's settings enable
them too; each workflow keeps its newest rows up to its cap (store.serving_raw), and the older rows they replace
are counted over the cap in the store, or here in `raw_not_enabled` when the agent keeps none."""

from __future__ import annotations

import threading
from typing import Any

from store import latency_sketch as ls
from store.db import Store
from store.errors import InvalidInput
from store.models import Workflow
from store.models_serving import ServingApp
from store.serving import COUNT_FIELDS, SUM_FIELDS, check_minute, merge_minutes, set_slo
from store.serving_raw import check_raw, write_raw
from store.settings import Settings
from store.workflows import upsert_workflow


def _add(into: dict[str, Any], rec: dict[str, Any]) -> None:
    for f in COUNT_FIELDS + SUM_FIELDS:
        into[f] += rec[f]
    if rec["met"] is not None:
        into["met"] = (into["met"] or 0) + rec["met"]
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
        self._devices: dict[str, int] = {}
        self._slos: dict[tuple[str, str], float] = {}
        self.taken = 0  # requests (served + dropped) accepted from jobs
        self.written = 0  # of which in the store
        self.refused_messages = 0

    def handle(self, msg: dict[str, Any]) -> None:
        """Check and merge one message; InvalidInput (the whole message refused) when any record is bad."""
        wf = msg["workflow"]
        try:
            minutes = [check_minute(r) for r in msg["minutes"]]
            devices = int(msg.get("devices") or 1)
            if devices < 1:
                raise InvalidInput(f"serving: devices={devices} < 1")
            slos = {str(a): float(s) for a, s in (msg.get("slos") or {}).items()}
            if any(not (s > 0) for s in slos.values()):
                raise InvalidInput("serving: every SLO must be a positive number of seconds")
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
            for r in minutes:
                key = (wf, r["app"], r["minute"])
                cur = self._pending.get(key)
                if cur is None:
                    self._pending[key] = r
                else:
                    _add(cur, r)
                self.taken += r["n"] + r["dropped"]
            self._devices[wf] = max(self._devices.get(wf, 1), devices)
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

    def pending(self) -> int:
        with self._lock:
            return sum(r["n"] + r["dropped"] for r in self._pending.values())

    def write(self, store: Store) -> int:
        """Write what is pending; returns the requests written. Any failure (DatabaseUnavailable, or another
        agent's transaction winning a deadlock) keeps everything for the next write and raises. Workflows go in
        sorted order, so two agents writing the same ones lock their rows in the same order (store.rows)."""
        with self._lock:
            if not self._pending and not self._raw and not self._raw_over:
                return 0
            pending, self._pending = self._pending, {}
            raw, self._raw = self._raw, {}
            raw_over, self._raw_over = self._raw_over, {}
            devices = dict(self._devices)
            slos = dict(self._slos)
        by_wf: dict[str, list[dict[str, Any]]] = {}
        for (wf, _app, _minute), r in pending.items():
            by_wf.setdefault(wf, []).append(r)
        try:
            with store.session() as session:
                added = 0
                for wf, recs in sorted(by_wf.items()):
                    if session.get(Workflow, wf) is None:
                        upsert_workflow(session, wf, id_source="env", labels={"kind": "serving"})
                    for (swf, app), s in sorted(slos.items()):
                        row = session.get(ServingApp, (swf, app)) if swf == wf else None
                        if swf == wf and (row is None or row.slo_s != s):
                            set_slo(session, wf, app, s)
                    added += merge_minutes(session, wf, recs, devices=devices.get(wf, 1))
                for wf in sorted(set(raw) | set(raw_over)):
                    if session.get(Workflow, wf) is None:
                        upsert_workflow(session, wf, id_source="env", labels={"kind": "serving"})
                    write_raw(session, wf, raw.get(wf, []), self.raw_cap, over_cap=raw_over.get(wf, 0))
        except Exception:
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
            raise
        with self._lock:
            self.written += sum(r["n"] + r["dropped"] for r in pending.values())
        return added
