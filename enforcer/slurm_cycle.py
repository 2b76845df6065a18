"""The Slurm part of an enforcement cycle (FLEETLENS_SLURM): plan from what the Slurm import recorded and the jobs'
samples, and hand the moves of jobs that opted in to the Slurm actuator (the cycle's driver carries them on).
Nothing is signalled, held or changed unless enforcement is on and the job opted in (the actuator checks again)."""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

import numpy as np
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from enforcer.actuators.slurm import TERMINAL, SlurmActuator
from enforcer.slurm_plan import SlurmHolding, plan_slurm_moves
from store.db import Store
from store.device_memory import known_memory
from store.errors import FleetlensError
from store.models import Action, Device, Host, Placement, ProcessSample, Workflow
from store.models_slurm import SlurmJob as SlurmJobRow
from store.registry import closed_hosts, silent_hosts
from store.settings import Settings
from store.slurm import finest_shards

log = logging.getLogger(__name__)


def slurm_holdings(store: Store, settings: Settings, *, now: float) -> list[SlurmHolding]:
    """The running Slurm jobs that hold GPUs, with their use over the window (`used_p95`), the most shards a GPU
    of their node has (from the import's host labels), and whether their node is heard from and takes new jobs (the
    store's one rule for every host: store.registry.silent_hosts and closed_hosts)."""
    with store.session() as session:
        used = used_p95(session, since=now - settings.slurm_usage_window_s)
        placed = {wf: d for wf, d in session.execute(
            select(Placement.workflow_id, func.min(Placement.device_id)).where(Placement.state == "active")
            .group_by(Placement.workflow_id))}
        rows = list(session.scalars(select(SlurmJobRow).where(SlurmJobRow.state == "RUNNING")))
        workflows = {w.id: w for w in session.scalars(select(Workflow).where(
            Workflow.id.in_([r.workflow_id for r in rows])))}
        memory = {wf: known_memory(session, w, settings.memory_seen_steps) for wf, w in workflows.items()}
        device_memory = dict(session.execute(select(Device.id, Device.memory_total).where(
            Device.id.in_([d for d in placed.values() if d is not None]))).tuples().all())
        per_gpu = {}
        nodes = {r.node for r in rows if r.node}
        for host in session.scalars(select(Host).where(Host.id.in_(nodes))):
            slurm = (host.labels or {}).get("slurm") or {}
            per_gpu[host.id] = finest_shards(int(slurm.get("gpus", 0)), int(slurm.get("shards", 0)))
        silent = silent_hosts(session, nodes, settings.host_silence_s, now)
        closed = closed_hosts(session, nodes)
        return [SlurmHolding(workflow_id=r.workflow_id, job_id=r.job_id, gres_kind="gpu" if r.gpus else "shard",
                             count=r.gpus or r.shards, shards_per_gpu=per_gpu.get(r.node or "", 0),
                             used=used.get(r.workflow_id),
                             opted_in=r.opted_in, not_movable_reason=r.not_movable_reason,
                             device_id=placed.get(r.workflow_id), memory=memory.get(r.workflow_id),
                             device_memory=device_memory.get(placed.get(r.workflow_id)), node=r.node,
                             not_heard_from=silent.get(r.node or ""), closed=closed.get(r.node or ""))
                for r in rows if r.gpus or r.shards]


def used_p95(session: Session, *, since: float) -> dict[str, float]:
    """Each Slurm job's use of one GPU since `since`: the p95 over its readings of what all its processes on one
    device used at one time together (SM utilisation on a GPU, CPU time on the cpu source), at most the whole device.
    Its processes are summed, not averaged: NVML reads a process that holds a context and runs no kernel as 0, and
    such a process beside the one that trains would otherwise halve the job's use."""
    totals: dict[str, list[float]] = defaultdict(list)
    for wf, total in session.execute(
            select(ProcessSample.workflow_id, func.sum(func.coalesce(ProcessSample.sm_util, ProcessSample.cpu_util)))
            .where(ProcessSample.ts >= since, ProcessSample.workflow_id.like("slurm-%"))
            .group_by(ProcessSample.workflow_id, ProcessSample.ts, ProcessSample.device_id)):
        if total is not None:
            totals[wf].append(min(1.0, float(total)))
    return {wf: float(np.quantile(values, 0.95)) for wf, values in totals.items()}


def run_slurm_cycle(store: Store, settings: Settings, *, apply: bool, now: float,
                    actuator: SlurmActuator | None = None) -> dict[str, Any]:
    """Plan, and begin the moves when applying; a summary for the cycle's result. The cycle's driver
    (enforcer.actuators.drive) carries the moves on through the Slurm actuator, like every engine's."""
    actuator = actuator or SlurmActuator(store, settings)
    with store.session() as session:
        # a job with a move under way, or one that ended within the cool-down, is left alone: the import after a
        # move may not have come yet, and its samples are still the old request's
        busy = frozenset(session.scalars(select(Action.workflow_id).where(
            Action.engine == "slurm",
            Action.state.not_in(TERMINAL) | (Action.updated_at >= now - settings.cooldown_s))))
    holdings = slurm_holdings(store, settings, now=now)
    moves, advice, skipped = plan_slurm_moves(holdings, busy=busy, max_moves=settings.max_moves_per_cycle,
                                              policy=settings.policy)
    begun: list[int] = []
    errors: list[str] = []
    if apply:
        for move in moves:
            try:
                begun.append(actuator.begin(move, now=now))
            except FleetlensError as exc:
                errors.append(str(exc))
    return {"mode": "enforce" if apply else "dry_run", "moves": [m.workflow_id for m in moves], "begun": begun,
            "advice": {a.workflow_id: a.message for a in advice}, "errors": errors, "skipped": skipped,
            # the nodes of the running jobs that are left alone (not heard from) or take no move, and why
            "not_heard_from": {h.node: h.not_heard_from for h in holdings if h.node and h.not_heard_from},
            "closed": {h.node: h.closed for h in holdings if h.node and h.closed and not h.not_heard_from}}
