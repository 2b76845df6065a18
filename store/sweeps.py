"""A sweep's records: the sweep and every start, resize, hold-back and end of its trials, and the GPU use they add
up to (what the Sweeps page draws, against one trial per GPU)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, insert, select

from store.db import Store
from store.errors import InvalidInput, NotFound
from store.models import Workflow
from store.models_sweeps import Sweep, SweepEvent

KINDS = ("start", "resize", "keep", "wait", "finish", "died")


@dataclass(frozen=True)
class EventRow:
    seq: int
    ts: float
    trial_id: str
    kind: str
    old_width: float
    new_width: float
    steps_left: float | None
    reason: str


def record_sweep(store: Store, sweep_id: str, gpus: int, settings: dict[str, Any], *, engine: str = "ray_tune",
                 now: float | None = None) -> None:
    """Register a sweep (again: its settings are updated)."""
    if not sweep_id:
        raise InvalidInput("a sweep needs a name (the Ray Tune experiment, or FLEETLENS_SWEEP)")
    with store.session() as session:
        row = session.get(Sweep, sweep_id)
        if row is None:
            session.add(Sweep(id=sweep_id, engine=engine, gpus=gpus, settings=settings,
                              created_at=time.time() if now is None else now))
        else:
            row.gpus, row.settings, row.engine = gpus, settings, engine


def record_event(store: Store, sweep_id: str, trial_id: str, kind: str, old_width: float, new_width: float, *,
                 reason: str = "", steps_left: float | None = None, now: float | None = None) -> int:
    """Append one event of a trial; returns its sequence number in the sweep.

    Several writers may append to one sweep at once (two drivers, or two Ray Tune experiments sharing a sweep id).
    Each takes the next number after every event committed before it, so a sweep's events are numbered 0, 1, 2, ...
    in the order they were committed, each number once. On PostgreSQL the sweep's row is locked first
    (SELECT ... FOR UPDATE): a second writer waits for the first one's commit, and its INSERT then sees that event.
    On SQLite the number is read in the INSERT itself, which holds the database's one write lock from its start."""
    if kind not in KINDS:
        raise InvalidInput(f"unknown sweep event {kind!r}; known: {', '.join(KINDS)}")
    with store.session() as session:
        if session.scalar(select(Sweep.id).where(Sweep.id == sweep_id).with_for_update()) is None:
            raise NotFound(f"sweep {sweep_id!r} is not recorded; record_sweep first")
        next_seq = (select(func.coalesce(func.max(SweepEvent.seq), -1) + 1)
                    .where(SweepEvent.sweep_id == sweep_id).scalar_subquery())
        seq = session.scalar(insert(SweepEvent).values(
            sweep_id=sweep_id, seq=next_seq, ts=time.time() if now is None else now, trial_id=trial_id, kind=kind,
            old_width=old_width, new_width=new_width, steps_left=steps_left, reason=reason).returning(SweepEvent.seq))
    return int(seq)


def sweeps(store: Store) -> list[dict[str, Any]]:
    with store.session() as session:
        rows = session.scalars(select(Sweep).order_by(Sweep.created_at.desc())).all()
        return [{"id": r.id, "engine": r.engine, "gpus": r.gpus, "settings": dict(r.settings),
                 "created_at": r.created_at} for r in rows]


def labelled_trials(store: Store) -> list[dict[str, Any]]:
    """Workflows that said they are trials of a sweep (FLEETLENS_SWEEP, through the job SDK), by sweep and trial.

    Labels are JSON on SQLite and JSONB on PostgreSQL; the few workflows are filtered here rather than in two SQL
    dialects."""
    with store.session() as session:
        rows = session.execute(select(Workflow.id, Workflow.labels, Workflow.state, Workflow.last_seen)).all()
    out = [{"sweep": labels["sweep"], "trial": labels.get("trial") or wf, "workflow": wf, "state": state,
            "last_seen": seen} for wf, labels, state, seen in rows if isinstance(labels, dict) and labels.get("sweep")]
    return sorted(out, key=lambda r: (str(r["sweep"]), str(r["trial"])))


def events(store: Store, sweep_id: str) -> list[EventRow]:
    with store.session() as session:
        # by id within a number: events that concurrent writers recorded before numbering was serialised may share one
        rows = session.scalars(select(SweepEvent).where(SweepEvent.sweep_id == sweep_id)
                               .order_by(SweepEvent.seq, SweepEvent.id)).all()
        return [EventRow(r.seq, r.ts, r.trial_id, r.kind, r.old_width, r.new_width, r.steps_left, r.reason)
                for r in rows]


def gpu_use(rows: list[EventRow], gpus: int) -> list[tuple[float, float, float]]:
    """(time, GPUs the sweep held, GPUs one trial per GPU would hold for the same running trials) after each event.

    A trial holds its width from its start to its finish, or to a wait (a trial waits only when it runs nothing: a
    pause gives its GPUs back until it starts again); one trial per GPU holds one GPU per running trial, at most the
    sweep's GPUs.
    """
    width: dict[str, float] = {}
    out: list[tuple[float, float, float]] = []
    for r in rows:
        if r.kind in ("start", "resize", "keep"):
            width[r.trial_id] = r.new_width
        elif r.kind in ("wait", "finish", "died"):
            width.pop(r.trial_id, None)
        out.append((r.ts, sum(width.values()), float(min(len(width), gpus))))
    return out
