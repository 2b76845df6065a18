"""Serving workflows in the store: per-application per-minute request histograms (merged, never overwritten),
SLOs per application, and the reads the findings, right-sizing and the dashboard share.

A minute record (what the SDK sends through the agent) is a dict with app, minute, n, dropped, met (or None),
exec_sum, exec_sumsq, wait_sum, latency_sum, batch_sum, exec_hist, latency_hist (store.latency_sketch dicts), and
exec_by_batch: the execution times per batch-size class (store.batch_sizes), or None (absent) when the minute was
recorded without them. A request's execution time is its batch's: only within one batch size does its spread say
how much the model's own time varies.

An application's name is a non-empty string of at most MAX_APP characters, everywhere (minutes, SLOs, raw
requests): a longer one is refused, never cut, so two applications never share a row and an SLO always finds its
minutes (`check_app`).
"""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import func, null, select, update
from sqlalchemy.orm import Session

from store import batch_sizes as bs
from store import latency_sketch as ls
from store.errors import InvalidInput
from store.models_serving import ServingApp, ServingMinute
from store.rows import insert_missing, locked_row
from store.workflows import get_workflow

SUM_FIELDS = ("exec_sum", "exec_sumsq", "wait_sum", "latency_sum")
COUNT_FIELDS = ("n", "dropped", "batch_sum")
MAX_APP = ServingMinute.__table__.c.app.type.length  # 255: the store's column


def check_app(app: Any, what: str) -> str:
    """An application's name as every serving table takes it; InvalidInput (naming `what` was refused) when it is
    not a non-empty string of at most MAX_APP characters."""
    if not isinstance(app, str) or not app.strip():
        raise InvalidInput(f"{what}: no application (an application is a non-empty string)")
    if len(app) > MAX_APP:
        raise InvalidInput(f"{what}: application {app[:40]!r}... is {len(app)} characters long, more than "
                           f"{MAX_APP} (a name over {MAX_APP} characters is refused, never cut)")
    return app


def check_slo(app: Any, slo_s: Any) -> tuple[str, float]:
    """An SLO as the store takes it (the application's name, positive finite seconds); InvalidInput says why not."""
    app = check_app(app, "SLO")
    if isinstance(slo_s, bool) or not isinstance(slo_s, numbers.Real) or not (slo_s > 0 and math.isfinite(slo_s)):
        raise InvalidInput(f"SLO for {app!r}: {slo_s!r} is not a positive number of seconds")
    return app, float(slo_s)


def merge_met(met: int | None, n: int, other_met: int | None, other_n: int) -> int | None:
    """The requests within the SLO of two parts of one minute: their sum, or None (no SLO was known for some of
    them) when either part served requests without one. A part that served none met its SLO for all of them (0)."""
    met = 0 if n == 0 else met
    other_met = 0 if other_n == 0 else other_met
    return None if met is None or other_met is None else met + other_met


def check_minute(rec: Mapping[str, Any]) -> dict[str, Any]:
    """A minute record made safe to store: InvalidInput names what is wrong (no application, a negative count,
    histogram counts that do not add up to n, batch-size classes whose counts do not add up to n or whose batch
    sizes do not add up to batch_sum)."""
    if not isinstance(rec, Mapping):
        raise InvalidInput("serving minute: a record must be an object")
    app = check_app(rec.get("app"), "serving minute")
    minute = rec.get("minute")
    if not isinstance(minute, int | float) or isinstance(minute, bool) or not math.isfinite(minute):
        raise InvalidInput(f"serving minute for {app!r}: minute {minute!r} is not a time")
    out: dict[str, Any] = {"app": app, "minute": float(minute) - float(minute) % 60.0}
    for f in COUNT_FIELDS:
        v = rec.get(f, 0)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise InvalidInput(f"serving minute for {app!r}: {f}={v!r} is not a whole number >= 0")
        out[f] = v
    for f in SUM_FIELDS:
        v = rec.get(f, 0.0)
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
            raise InvalidInput(f"serving minute for {app!r}: {f}={v!r} is not a finite number >= 0")
        out[f] = float(v)
    met = rec.get("met")
    if met is not None and (isinstance(met, bool) or not isinstance(met, int) or not 0 <= met <= out["n"]):
        raise InvalidInput(f"serving minute for {app!r}: met={met!r} is not a count between 0 and n")
    out["met"] = met
    for f in ("exec_hist", "latency_hist"):
        hist = ls.from_json(rec.get(f))
        if ls.total(hist) != out["n"]:
            raise InvalidInput(f"serving minute for {app!r}: {f} counts {ls.total(hist)} requests, n says {out['n']}")
        out[f] = hist
    what = f"serving minute for {app!r}"
    by_batch = bs.from_json(rec.get("exec_by_batch"), f"{what}: exec_by_batch")
    bs.check_totals(by_batch, out["n"], out["batch_sum"], what)
    out["exec_by_batch"] = by_batch
    return out


def _checked(rec: Mapping[str, Any]) -> bool:
    """Whether a record is check_minute's (the agent's sink checks each once): histograms with whole-number keys,
    batch-size classes as SizeClass."""
    by_batch = rec.get("exec_by_batch")
    return (isinstance(rec.get("exec_hist"), dict) and all(isinstance(k, int) for k in rec["exec_hist"])
            and "exec_by_batch" in rec
            and (by_batch is None or all(isinstance(v, bs.SizeClass) for v in by_batch.values())))


def merge_minutes(session: Session, workflow_id: str, records: Iterable[Mapping[str, Any]], *,
                  devices: int = 1) -> int:
    """Add checked minute records into the workflow's rows (creating them); returns the requests added. Agents on
    several hosts add into one row at once: each row is locked while it is added to, in (app, minute) order
    (store.rows), so no addition is lost and no two writers deadlock.

    A record's `devices` (else `devices`) is what the service reported holding in that minute: the row keeps the
    largest any writer reported for it (each replica of a service reports the devices of the whole service)."""
    checked = [{**(rec if _checked(rec) else check_minute(rec)), "devices": int(rec.get("devices") or devices)}
               for rec in records]
    added = 0
    for r in sorted(checked, key=lambda r: (r["app"], r["minute"])):
        row = locked_row(session, ServingMinute, {"workflow_id": workflow_id, "app": r["app"], "minute": r["minute"]},
                         n=0, dropped=0, met=None, exec_sum=0.0, exec_sumsq=0.0, wait_sum=0.0, latency_sum=0.0,
                         batch_sum=0, devices=r["devices"], exec_hist={}, latency_hist={}, exec_by_batch={})
        row.met = merge_met(row.met, row.n, r["met"], r["n"])
        by_batch = bs.merge_parts(bs.from_json(row.exec_by_batch), row.n, r.get("exec_by_batch"), r["n"])
        if by_batch is None:  # SQL NULL, as the rows from before revision 0016 have, not a JSON null
            row.exec_by_batch = null()
            session.flush()  # read back as None should the same minute come again in this call
        else:
            row.exec_by_batch = bs.to_json(by_batch)
        for f in COUNT_FIELDS + SUM_FIELDS:
            setattr(row, f, getattr(row, f) + r[f])
        row.devices = max(row.devices or 1, r["devices"])
        row.exec_hist = ls.to_json(ls.merge(ls.from_json(row.exec_hist), r["exec_hist"]))
        row.latency_hist = ls.to_json(ls.merge(ls.from_json(row.latency_hist), r["latency_hist"]))
        added += r["n"]
    session.flush()
    return added


def set_slo(session: Session, workflow_id: str, app: str, slo_s: float | None, *, target: float = 0.99,
            now: float | None = None) -> ServingApp:
    """The operator's SLO (`fleetlens serving slo`): sets the application's SLO and target, whatever the SDK
    declared (declare_slo never changes them afterwards). A new SLO clears the exact `met` of the minutes stored
    already (the SDK counted them against another), so their attainment comes from the latency histogram."""
    if slo_s is None:
        app = check_app(app, "SLO")
    else:
        app, slo_s = check_slo(app, slo_s)
    if not 0 < target <= 1:
        raise InvalidInput(f"SLO target for {app!r}: {target!r} is not a share in (0, 1]")
    get_workflow(session, workflow_id)  # an SLO belongs to a workflow the store knows (a typo would hide it)
    now = time.time() if now is None else now
    missing = session.get(ServingApp, (workflow_id, app)) is None
    row = locked_row(session, ServingApp, {"workflow_id": workflow_id, "app": app}, slo_s=slo_s, target=target,
                     updated_at=now)
    if missing or row.slo_s != slo_s:
        session.execute(update(ServingMinute).where(ServingMinute.workflow_id == workflow_id, ServingMinute.app == app)
                        .values(met=None).execution_options(synchronize_session=False))
    row.slo_s, row.target, row.updated_at = slo_s, target, now
    session.flush()
    return row


def declare_slo(session: Session, workflow_id: str, app: str, slo_s: float, *, now: float | None = None) -> bool:
    """The SLO a serving job's SDK declares: it fills in an application that has none stored (target 0.99), and
    leaves one already stored as it is, so an SLO or target the operator set is never undone. True if stored."""
    app, slo_s = check_slo(app, slo_s)
    if session.get(ServingApp, (workflow_id, app)) is not None:
        return False
    get_workflow(session, workflow_id)
    # the agents of a replicated service declare its SLOs at once: the first insert wins, the others do nothing
    insert_missing(session, ServingApp, {"workflow_id": workflow_id, "app": app, "slo_s": slo_s, "target": 0.99,
                                         "updated_at": time.time() if now is None else now})
    session.flush()
    return True


@dataclass
class AppWindow:
    """One application of one serving workflow over a window: counts exact, quantiles to 1 %. `exec_by_batch` sums
    the batch-size classes of the minutes that have them (`batch_sized` of the `n` requests: minutes stored before
    revision 0016 have none)."""

    workflow_id: str
    app: str
    n: int = 0
    dropped: int = 0
    met_exact: int | None = 0  # None once a minute with requests had no SLO known (store.serving.merge_met)
    exec_sum: float = 0.0
    exec_sumsq: float = 0.0
    latency_sum: float = 0.0
    wait_sum: float = 0.0
    batch_sum: int = 0
    devices: int = 1  # the devices the service held in the window's newest minute
    slo_s: float | None = None
    target: float = 0.99
    exec_hist: dict[int, int] = field(default_factory=dict)
    latency_hist: dict[int, int] = field(default_factory=dict)
    exec_by_batch: bs.ByBatch = field(default_factory=dict)
    batch_sized: int = 0  # requests of the minutes with batch-size classes
    minutes: list[tuple[float, int, int, int | None]] = field(default_factory=list)  # (minute, n, dropped, met)
    first: float = math.inf
    last: float = -math.inf

    @property
    def exec_mean(self) -> float:
        return self.exec_sum / self.n if self.n else math.nan

    @property
    def exec_cv(self) -> float:
        if self.n < 2:
            return math.nan
        mean = self.exec_mean
        var = max(0.0, self.exec_sumsq / self.n - mean * mean)
        return math.sqrt(var) / mean if mean > 0 else math.nan

    @property
    def exec_cv_quartiles(self) -> float:
        """The CV of execution times over all batch sizes, from the quartiles (ls.quartile_cv): it mixes what
        batching does to a batch's time with the model's own variation (see exec_cv_within_batch)."""
        return ls.quartile_cv(self.exec_hist)

    def exec_cv_by_batch(self, min_requests: int = 1) -> dict[int, tuple[int, float]]:
        """Each batch-size class with at least `min_requests` requests: (requests, quartile CV of its times)."""
        return {c: (sc.n, ls.quartile_cv(sc.hist)) for c, sc in sorted(self.exec_by_batch.items())
                if sc.n >= max(1, min_requests)}

    def exec_cv_within_batch(self, min_requests: int = 1) -> tuple[float, int]:
        """The execution-time CV within batch sizes: the request-weighted mean of the quartile CVs of the classes
        with at least `min_requests` requests, and the requests those hold (NaN, 0 when none has)."""
        judged = [(n, cv) for n, cv in self.exec_cv_by_batch(min_requests).values() if not math.isnan(cv)]
        covered = sum(n for n, _ in judged)
        return (sum(n * cv for n, cv in judged) / covered if covered else math.nan), covered

    def met(self) -> int | None:
        """Requests served within the SLO: the SDK's exact count when it knew the SLO for every minute, else from
        the latency histogram (to within one 2 % bucket); None without an SLO."""
        if self.slo_s is None:
            return None
        if self.met_exact is not None:
            return self.met_exact
        return ls.count_at_most(self.latency_hist, self.slo_s)

    def attainment(self) -> float | None:
        """Share of requests (served or shed) that met the SLO."""
        met = self.met()
        total = self.n + self.dropped
        return None if met is None or total == 0 else met / total


def app_windows(session: Session, since: float, until: float,
                workflow_ids: Iterable[str] | None = None) -> list[AppWindow]:
    """Every serving application with requests in [since, until), its minutes summed, with its SLO."""
    q = select(ServingMinute).where(ServingMinute.minute >= since - 60.0, ServingMinute.minute < until)
    if workflow_ids is not None:
        q = q.where(ServingMinute.workflow_id.in_(list(workflow_ids)))
    out: dict[tuple[str, str], AppWindow] = {}
    for row in session.scalars(q.order_by(ServingMinute.minute)):
        if row.minute + 60.0 <= since:
            continue
        w = out.setdefault((row.workflow_id, row.app), AppWindow(row.workflow_id, row.app))
        w.met_exact = merge_met(w.met_exact, w.n, row.met, row.n)
        w.n += row.n
        w.dropped += row.dropped
        w.exec_sum += row.exec_sum
        w.exec_sumsq += row.exec_sumsq
        w.latency_sum += row.latency_sum
        w.wait_sum += row.wait_sum
        w.batch_sum += row.batch_sum
        w.devices = row.devices or 1  # what the service holds now: its newest minute's (rows come oldest first)
        ls.merge(w.exec_hist, row.exec_hist or {})
        ls.merge(w.latency_hist, row.latency_hist or {})
        by_batch = bs.from_json(row.exec_by_batch) if row.n else None
        if by_batch is not None:
            bs.add(w.exec_by_batch, by_batch)
            w.batch_sized += row.n
        w.minutes.append((row.minute, row.n, row.dropped, row.met))
        w.first, w.last = min(w.first, row.minute), max(w.last, row.minute + 60.0)
    if out:
        for slo in session.scalars(select(ServingApp).where(
                ServingApp.workflow_id.in_({k[0] for k in out}))):
            w = out.get((slo.workflow_id, slo.app))
            if w is not None:
                w.slo_s, w.target = slo.slo_s, slo.target
    return list(out.values())


def last_request_minute(session: Session, workflow_id: str) -> float | None:
    """Start of the newest minute with requests recorded for the workflow (epoch seconds), None if it has none."""
    return session.scalar(select(func.max(ServingMinute.minute)).where(ServingMinute.workflow_id == workflow_id))
