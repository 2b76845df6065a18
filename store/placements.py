"""Placement writes shared by whoever starts, ends or moves a managed job: started, ended, withdrawn, and closing
lanes left empty."""

from __future__ import annotations

import time
from collections.abc import Sequence

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from store.db import Store
from store.headroom import charged
from store.models import Action, Device, Lane, Placement, Workflow
from store.rows import merge_labels


def mark_started(store: Store, workflow_id: str, placement_ids: Sequence[int], pid: int) -> None:
    """The job runs as `pid`: its placements become active and the workflow running."""
    with store.session() as session:
        session.execute(update(Placement).where(Placement.id.in_(list(placement_ids)))
                        .values(pid=pid, state="active"))
        session.execute(update(Workflow).where(Workflow.id == workflow_id).values(state="running"))


FAILURE_LABEL = "failure"  # workflows.labels: why the workflow's job failed, when fleetlens knows


def end_placements(store: Store, workflow_id: str, pid: int | None, outcome: str, *, now: float | None = None,
                   out_of_memory: bool | str | None = False) -> int:
    """The job's process `pid` ended: its active placements end and empty lanes close; returns how many ended.

    `out_of_memory`: it died for want of memory, so the workflow fails with "exceeded its memory share of N bytes"
    (its admitted P' + E in its lane, or its whole device) in its labels; "device" when it was within its share and
    the GPU itself was full (a neighbour, or memory outside every share): then that is what the label says. A
    workflow being moved is left to the migration (it ends the old placement itself)."""
    now = time.time() if now is None else now
    with store.session() as session:
        wf = session.get(Workflow, workflow_id)
        if wf is None or wf.state == "moving":
            return 0
        rows = list(session.scalars(select(Placement).where(
            Placement.workflow_id == workflow_id, Placement.state.in_(("active", "pending")),
            *([Placement.pid == pid] if pid is not None else []))))
        for p in rows:
            p.state, p.ended_at = "ended", now
        session.flush()
        close_empty_lanes(session, {p.lane_id for p in rows if p.lane_id is not None}, now)
        if out_of_memory and outcome != "finished":
            shares = [memory_share(session, p) for p in rows]
            share = f"its memory share of {max(shares)} bytes" if shares and all(shares) else "its memory"
            why = (f"ran out of GPU memory within {share}: the GPU was full (a neighbour over its share, or memory "
                   "outside the shares)" if out_of_memory == "device" else f"exceeded {share} (out of memory)")
            merge_labels(session, wf, {FAILURE_LABEL: why})
        if wf.state == "running":
            wf.state = "finished" if outcome == "finished" else "failed"
        return len(rows)


def memory_share(session: Session, placement: Placement) -> int | None:
    """The bytes a placement may use: P' + E admitted in its lane, or the whole device's memory."""
    if placement.lane_id is not None and placement.mem_persistent is not None:
        return charged(int(placement.mem_persistent)) + int(placement.mem_ephemeral or 0)
    device = session.get(Device, placement.device_id)
    return int(device.memory_total) if device is not None and device.memory_total else None


def withdraw_placement(session: Session, workflow_id: str, placement_ids: Sequence[int], lane_id: int | None,
                       *, now: float | None = None) -> None:
    """Undo a placement whose job never started: the placements end, its lane closes if left empty."""
    now = time.time() if now is None else now
    session.execute(update(Placement).where(Placement.id.in_(list(placement_ids)))
                    .values(state="ended", ended_at=now))
    session.flush()
    if lane_id is not None:
        close_empty_lanes(session, {lane_id}, now)
    session.execute(update(Workflow).where(Workflow.id == workflow_id).values(state="failed"))


MOVE_OVER = ("resumed", "rolled_back", "failed")  # action states after which a move no longer holds its target lane


def close_empty_lanes(session: Session, lane_ids: set[int], now: float) -> None:
    """Close each of these lanes that no active or pending placement uses any more, and no move under way is taking
    a job into (its lane-mates may all have ended before it arrives: the lane stays reserved for it; the move
    closes it when it ends, if it is still empty then)."""
    for lane_id in lane_ids:
        busy = session.scalar(select(Placement.id).where(
            Placement.lane_id == lane_id, Placement.state.in_(("active", "pending"))).limit(1))
        if busy is None:
            busy = session.scalar(select(Action.id).where(
                Action.to_lane_id == lane_id, Action.state.not_in(MOVE_OVER)).limit(1))
        if busy is None:
            session.execute(update(Lane).where(Lane.id == lane_id, Lane.state == "open")
                            .values(state="closed", closed_at=now))
