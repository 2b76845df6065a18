"""The store side of consolidation: read placements and each workflow's observed demand, plan with
enforcer.consolidate, record the plan (policy "consolidate", each move with its reason) and optionally apply it.

A workflow's demand on its device is what its processes' samples show there over the window: memory summed over
its processes per sample time, utilisation the highest any of them reported (GPU SM, else the cpu source's share
of the device's cores). The plan is recorded in `plans` like the planner's, so applying it goes through the same
`apply_plan` and the migration state machine, and the dashboard reads both the same way.

Each job comes with the hosts that recently said they can read its checkpoint location (the same facts, from the
same helper, as the planner's: store.checkpoints.readable_hosts_by_workflow), and each device with its host, so
consolidation plans no move a target agent could not resume from; the jobs it keeps for that reason are listed
in the plan's summary under "refused", each with what the target host's agent said. The hosts not heard from lately
(the fleet state's `not_heard_from`) are left alone: no job is moved onto or off their devices; the Slurm nodes that
take no new job (its `closed`: drained, draining, in maintenance, reserved) take no move, and their jobs may leave.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from dataclasses import asdict

import numpy as np
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from enforcer.consolidate import ConsolidationPlan, lane_bytes, plan_consolidation
from enforcer.consolidation_sizing import ConsolidateParams, JobDemand
from enforcer.fleet_state import FleetState, read_fleet_state
from enforcer.plan_store import apply_plan, explain_refusals
from enforcer.planner import Move
from store.checkpoints import latest_checkpoint_times
from store.db import Store
from store.headroom import PERSISTENT_FACTOR
from store.models import Action, Plan, ProcessSample
from store.settings import Settings

POLICY = "consolidate"
DAY_S = 86400.0


def load_demands(session: Session, settings: Settings, now: float, params: ConsolidateParams,
                 state: FleetState | None = None) -> tuple[list[tuple[int, int]], list[JobDemand], dict[int, str]]:
    """Devices ((id, bytes)), every placed workflow's demand up to `now` (with the hosts that can read its
    checkpoint location), and each device's host, from the fleet state: a device's bytes are its free capacity
    (enforcer.fleet_state's one rule). A job on several devices holds each whole and is not moved (one demand per
    device, `<workflow>#<k>`, as the simulator gives them); nor is a job registered but not started (a pending
    placement), which holds the lane or device admission gave it. A job on its way into a lane (a move under way)
    holds its share of it there (`arriving:<workflow>`). `state`: the fleet state already read at `now` (else it is
    read here)."""
    state = state or read_fleet_state(session, now=now, settings=settings)
    devices = [(d.device_id, state.free_capacity(d.device_id)) for d in state.devices.values() if d.memory_total]
    hosts = {d.device_id: d.host for d in state.devices.values() if d.memory_total}
    since = now - params.window_s
    samples = session.execute(
        select(ProcessSample.workflow_id, ProcessSample.device_id, ProcessSample.ts,
               func.sum(ProcessSample.mem_used), func.max(func.coalesce(ProcessSample.sm_util,
                                                                        ProcessSample.cpu_util)))
        # from the window's first instant on, as size_jobs takes it (the simulator hands it every sample)
        .where(ProcessSample.ts >= since, ProcessSample.ts <= now)
        .group_by(ProcessSample.workflow_id, ProcessSample.device_id, ProcessSample.ts)
        .order_by(ProcessSample.ts)).all()
    series: dict[tuple[str, int], list[tuple[float, float, float]]] = defaultdict(list)
    for wf, dev, ts, mem, util in samples:
        if mem is None:
            continue  # a reading without memory says nothing about the lane the job needs
        series[(wf, dev)].append((float(ts), float(mem), float(util) if util is not None else 1.0))
    first_seen = dict(session.execute(
        select(ProcessSample.workflow_id, func.min(ProcessSample.ts)).group_by(ProcessSample.workflow_id)).all())
    moved = defaultdict(list)
    for wf, ts in session.execute(select(Action.workflow_id, Action.created_at)
                                  .where(Action.created_at > now - DAY_S)).all():
        moved[wf].append(float(ts))
    busy = set(session.scalars(select(Action.workflow_id).where(
        Action.state.not_in(("resumed", "rolled_back", "failed")))))
    checkpointed = latest_checkpoint_times(session, now)  # a move redoes the work since the latest one
    spans = Counter(p.workflow_id for p in state.placements)
    parts: dict[str, int] = defaultdict(int)
    demands = []
    for placement in state.placements:
        facts = state.workflows[placement.workflow_id]
        if placement.state != "active" and spans[facts.workflow_id] == 1:
            # registered, not started yet: no samples, but the room admission gave it is taken; it is not moved
            if placement.lane_id is None or placement.persistent is None:
                demands.append(JobDemand(facts.workflow_id, placement.device_id, declared_mem=0, declared_util=1.0,
                                         movable=False, whole=True))
            else:  # what NVML will show of it: P + E and its context, as admitted
                demands.append(JobDemand(
                    facts.workflow_id, placement.device_id,
                    declared_mem=placement.persistent + (placement.ephemeral or 0) + state.context_charge(placement),
                    declared_util=placement.compute_share or 1.0, movable=False))
            continue
        if spans[facts.workflow_id] > 1:
            # a multi-device job's devices stay its own, each a part named as the simulator names it
            k = parts[facts.workflow_id]
            parts[facts.workflow_id] += 1
            demands.append(JobDemand(f"{facts.workflow_id}#{k}", placement.device_id, declared_mem=0,
                                     declared_util=1.0, movable=False, whole=True, gpus=spans[facts.workflow_id]))
            continue
        pts = series.get((facts.workflow_id, placement.device_id), [])
        arr = np.array(pts, dtype=float).reshape(-1, 3)
        times, mem, util = arr[:, 0], arr[:, 1], np.clip(arr[:, 2], 0.0, 1.0)
        if len(times) and first_seen.get(facts.workflow_id) is not None and first_seen[facts.workflow_id] < times[0]:
            # history older than the window still counts towards how long the job has been watched
            times = np.concatenate([[float(first_seen[facts.workflow_id])], times])
            mem = np.concatenate([[mem[0]], mem])
            util = np.concatenate([[util[0]], util])
        # a job that never recorded a checkpoint: the move's own checkpoint is all there is; its cost is the downtime
        last_checkpoint = checkpointed.get(facts.workflow_id)
        demands.append(JobDemand(facts.workflow_id, placement.device_id, times, mem, util,
                                 movable=facts.movable and facts.workflow_id not in busy,
                                 moves=moved.get(facts.workflow_id, []),
                                 since_checkpoint_s=0.0 if last_checkpoint is None else now - last_checkpoint,
                                 readable_hosts=facts.readable_hosts))
    # jobs on their way into a lane (moves under way): the room they will take is theirs already
    placed = {(p.workflow_id, p.device_id) for p in state.placements}
    for a in state.arriving:
        if (a.workflow_id, a.device_id) not in placed:
            demands.append(JobDemand(f"arriving:{a.workflow_id}", a.device_id, declared_mem=a.share + a.ephemeral,
                                     declared_util=a.lane.compute_share or 1.0, movable=False))
    return devices, demands, hosts


def make_consolidation_plan(store: Store, settings: Settings, *, now: float | None = None,
                            apply: bool = False) -> tuple[int, ConsolidationPlan]:
    """Plan one consolidation cycle on the store's fleet, record it, apply it when asked; (plan id, plan)."""
    now = time.time() if now is None else now
    params = ConsolidateParams.from_settings(settings)
    with store.session() as session:
        state = read_fleet_state(session, now=now, settings=settings)
        devices, demands, hosts = load_demands(session, settings, now, params, state)
    plan = plan_consolidation(devices, demands, now, params, hosts=hosts, not_heard_from=state.not_heard_from,
                              closed=state.closed)
    if plan.refused:
        with store.session() as session:
            explain_refusals(session, plan.refused, settings, now)
    caps = dict(devices)
    moves = []
    for k, m in enumerate(plan.moves):
        size = plan.packing.sizes.get(m.job_id, plan.sizes[m.job_id]) if plan.packing else plan.sizes[m.job_id]
        cap = caps[m.to_device_id]
        lane = min(lane_bytes(size, cap), cap)
        moves.append(asdict(Move(
            workflow_id=m.job_id, from_device_id=m.from_device_id, to_device_id=m.to_device_id, to_lane_id=None,
            new_lane=f"c{k}", lane_size=lane, p_prime=min(int(size.mem * PERSISTENT_FACTOR), lane), ephemeral=0,
            util=size.util, compute_share=min(1.0, max(size.util, 1e-3)), expected_slowdown=1.0,
            rules=[m.reason], persistent=int(size.mem))))
    summary = {**plan.summary(), "freed_device_ids": plan.devices_freed,
               "move_reasons": [{"workflow": m.job_id, "reason": m.reason, "cost_s": m.cost_s,
                                 "gain_device_h": m.gain_device_h} for m in plan.moves],
               "sizes": {j: {"mem": s.mem, "util": round(s.util, 4), "why": s.why} for j, s in plan.sizes.items()}}
    with store.session() as session:
        row = Plan(created_at=now, policy=POLICY, applied=False, devices_freed=len(plan.devices_freed),
                   moves=moves, summary=summary)
        session.add(row)
        session.flush()
        plan_id = row.id
    if apply and moves:
        apply_plan(store, plan_id, settings=settings, now=now)
    return plan_id, plan


def consolidation_due(store: Store, settings: Settings, now: float) -> bool:
    """Whether the last consolidation plan is at least one interval old (or there is none)."""
    with store.session() as session:
        last = session.scalar(select(func.max(Plan.created_at)).where(Plan.policy == POLICY))
    return last is None or now - float(last) >= settings.consolidate_interval_s
