"""The agent's side of the SDK's serving mode: takes `serving` messages (per-application per-minute request
histograms), merges them in memory by workflow, application and minute, and writes them to the store on the
SDK writer's beat. A message with a bad record is refused whole, with the reason (the SDK raises it); what the
database cannot take yet stays merged in memory for the next try, so no request is lost or counted twice."""

from __future__ import annotations

import threading
from typing import Any

from store import latency_sketch as ls
from store.db import Store
from store.errors import DatabaseUnavailable, InvalidInput
from store.models import Workflow
from store.models_serving import ServingApp
from store.serving import COUNT_FIELDS, SUM_FIELDS, check_minute, merge_minutes, set_slo
from store.workflows import upsert_workflow


def _add(into: dict[str, Any], rec: dict[str, Any]) -> None:
    for f in COUNT_FIELDS + SUM_FIELDS:
        into[f] += rec[f]
    if rec["met"] is not None:
        into["met"] = (into["met"] or 0) + rec["met"]
    ls.merge(into["exec_hist"], rec["exec_hist"])
    ls.merge(into["latency_hist"], rec["latency_hist"])


class ServingSink:
    def __init__(self) -> None:
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

    def pending(self) -> int:
        with self._lock:
            return sum(r["n"] + r["dropped"] for r in self._pending.values())

    def write(self, store: Store) -> int:
        """Write what is pending; returns the requests written. DatabaseUnavailable keeps everything for later."""
        with self._lock:
            if not self._pending:
                return 0
            pending, self._pending = self._pending, {}
            devices = dict(self._devices)
            slos = dict(self._slos)
        by_wf: dict[str, list[dict[str, Any]]] = {}
        for (wf, _app, _minute), r in pending.items():
            by_wf.setdefault(wf, []).append(r)
        try:
            with store.session() as session:
                added = 0
                for wf, recs in by_wf.items():
                    if session.get(Workflow, wf) is None:
                        upsert_workflow(session, wf, id_source="env", labels={"kind": "serving"})
                    for (swf, app), s in slos.items():
                        row = session.get(ServingApp, (swf, app)) if swf == wf else None
                        if swf == wf and (row is None or row.slo_s != s):
                            set_slo(session, wf, app, s)
                    added += merge_minutes(session, wf, recs, devices=devices.get(wf, 1))
        except DatabaseUnavailable:
            with self._lock:
                for key, r in pending.items():
                    cur = self._pending.get(key)
                    if cur is None:
                        self._pending[key] = r
                    else:
                        _add(cur, r)
            raise
        with self._lock:
            self.written += sum(r["n"] + r["dropped"] for r in pending.values())
        return added
