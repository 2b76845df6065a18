"""Raw serving requests, opt-in and capped: each workflow keeps its newest `cap` request rows (by arrival), so what
is stored is always the recent past; each older row a newer one replaces is counted (serving_raw_counts.over_cap),
never dropped silently, and every request is in the minute histograms anyway.

A raw record (what the SDK sends when `serving_raw_requests` is on) is a list
[app, arrival, wait_s, exec_s, latency_s, batch_size]. Retention deletes old rows with the other sample data."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import delete, func, insert, select
from sqlalchemy.orm import Session

from store.errors import InvalidInput
from store.models_serving import ServingRawCount, ServingRequest
from store.rows import locked_row
from store.serving import check_app

RAW_FIELDS = ("app", "arrival", "wait_s", "exec_s", "latency_s", "batch_size")


def check_raw(rec: Any) -> dict[str, Any]:
    """One raw record made safe to store; InvalidInput says what is wrong."""
    if not isinstance(rec, list | tuple) or len(rec) != len(RAW_FIELDS):
        raise InvalidInput(f"serving raw request: {rec!r} is not [{', '.join(RAW_FIELDS)}]")
    app, arrival, wait, exec_s, latency, batch = rec
    app = check_app(app, "serving raw request")
    nums = {"arrival": arrival, "wait_s": wait, "exec_s": exec_s, "latency_s": latency}
    for name, v in nums.items():
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise InvalidInput(f"serving raw request for {app!r}: {name}={v!r} is not a finite number")
    if not exec_s > 0 or wait < 0 or latency < exec_s - 1e-9 or latency < wait:
        raise InvalidInput(f"serving raw request for {app!r}: times wait={wait!r}, exec={exec_s!r}, "
                           f"latency={latency!r} do not fit (exec > 0, wait >= 0, latency >= each)")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise InvalidInput(f"serving raw request for {app!r}: batch_size={batch!r} is not a whole number >= 1")
    return {"app": app, "arrival": float(arrival), "wait_s": float(wait), "exec_s": float(exec_s),
            "latency_s": float(latency), "batch_size": batch}


def write_raw(session: Session, workflow_id: str, records: Sequence[dict[str, Any]], cap: int, *,
              over_cap: int = 0) -> tuple[int, int]:
    """Store checked `records` of one workflow, then keep only its newest `cap` rows (by arrival): the older rows
    they replace are deleted and counted, as is `over_cap` already counted upstream (e.g. by the SDK's own buffer).
    Returns (rows inserted, requests counted over the cap by this call)."""
    if cap < 0:
        raise InvalidInput(f"serving_raw_max_rows={cap}: must be >= 0")
    # two agents writing one workflow share its cap: its counts row is locked while they add (store.rows)
    row = locked_row(session, ServingRawCount, {"workflow_id": workflow_id}, stored=0, over_cap=0)
    keep = list(records[-cap:]) if cap else []
    if keep:
        session.execute(insert(ServingRequest), [{"workflow_id": workflow_id, **r} for r in keep])
    replaced = 0  # older rows the new ones take the place of
    if (excess := row.stored + len(keep) - cap) > 0:
        oldest = (select(ServingRequest.id).where(ServingRequest.workflow_id == workflow_id)
                  .order_by(ServingRequest.arrival, ServingRequest.id).limit(excess))
        replaced = session.execute(delete(ServingRequest).where(ServingRequest.id.in_(oldest.scalar_subquery()))
                                   .execution_options(synchronize_session=False)).rowcount
    over = len(records) - len(keep) + over_cap + replaced
    row.stored += len(keep) - replaced
    row.over_cap += over
    session.flush()
    return len(keep), over


def raw_counts(session: Session, workflow_id: str) -> tuple[int, int]:
    """(raw requests stored, raw requests counted over the cap) of one workflow."""
    row = session.get(ServingRawCount, workflow_id)
    return (0, 0) if row is None else (row.stored, row.over_cap)


def all_raw_counts(session: Session) -> dict[str, tuple[int, int]]:
    """Every workflow that ever sent raw requests: (stored, counted over the cap)."""
    rows = session.scalars(select(ServingRawCount).order_by(ServingRawCount.workflow_id))
    return {r.workflow_id: (r.stored, r.over_cap) for r in rows}


def raw_requests(session: Session, workflow_id: str, since: float = -math.inf,
                 until: float = math.inf) -> list[ServingRequest]:
    q = select(ServingRequest).where(ServingRequest.workflow_id == workflow_id, ServingRequest.arrival >= since,
                                     ServingRequest.arrival < until)
    return list(session.scalars(q.order_by(ServingRequest.arrival, ServingRequest.id)))


def delete_raw_before(session: Session, cutoff: float) -> int:
    """Retention: raw requests that arrived before `cutoff` go (the minute histograms keep their counts), and each
    workflow's stored count with them. Returns the rows deleted."""
    gone: Iterable[tuple[str, int]] = session.execute(
        select(ServingRequest.workflow_id, func.count()).where(ServingRequest.arrival < cutoff)
        .group_by(ServingRequest.workflow_id)).tuples().all()
    total = 0
    for wf, n in gone:
        row = session.get(ServingRawCount, wf)
        if row is not None:
            row.stored = max(0, row.stored - int(n))
        total += int(n)
    if total:
        session.execute(delete(ServingRequest).where(ServingRequest.arrival < cutoff))
    session.flush()
    return total
