"""Reader for fleetlens's own store: the recorded workflows as jobs on the recorded devices ("what if")."""

from __future__ import annotations

import math

from sqlalchemy import func, select

from enforcer.fleet_state import read_fleet_state
from enforcer.sim.model import GIB, NodeSpec, ReadReport, SimJob, Trace
from store.db import Store
from store.models import ProcessSample, StepStat, Workflow

DEFAULT_DEVICE_MEM = 80 * GIB


def read_store(store: Store) -> Trace:
    """One job per workflow: arrival = created_at; work = its steps' time from step_stats (sum of n_steps x
    mean_s), else last_seen - created_at; memory = its SDK profile (P, E), else the peak process memory sampled;
    util = its mean sampled SM utilisation. The cluster is the fleet state's usable devices (grouped by host), each
    with its whole memory: the what-if replays the recorded jobs from an empty fleet.
    Workflows with no duration are skipped and counted."""
    report = ReadReport(f"store {store.url.render_as_string(hide_password=True)}")
    with store.session() as s:
        workflows = s.scalars(select(Workflow)).all()
        steps = dict(s.execute(
            select(StepStat.workflow_id, func.sum(StepStat.n_steps * StepStat.mean_s)).group_by(StepStat.workflow_id)
        ).all())
        samples = {
            w: (mem, util)
            for w, mem, util in s.execute(
                select(ProcessSample.workflow_id, func.max(ProcessSample.mem_used), func.avg(ProcessSample.sm_util))
                .group_by(ProcessSample.workflow_id)
            ).all()
        }
        state = read_fleet_state(s)
        devices = [(d.host, d.memory_total, d.kind) for d in state.devices.values()]
    report.rows = len(workflows)
    jobs = []
    for w in workflows:
        work = steps.get(w.id) or (w.last_seen - w.created_at)
        if not work or not math.isfinite(work) or work <= 0:
            report.skip("no_duration")
            continue
        peak, util = samples.get(w.id, (None, None))
        p, e = w.mem_persistent, w.mem_ephemeral
        mem = (p + e) if p is not None and e is not None else peak
        jobs.append(SimJob(
            w.id, float(w.created_at), float(work), gpus=max(1, w.gpus or 1), share=1.0,
            mem=int(mem) if mem else None, mem_persistent=p, mem_ephemeral=e,
            util=float(util) if util is not None else None, model=w.name,
        ))
    report.jobs = len(jobs)
    by_host: dict[str, list[tuple[int, str]]] = {}
    for host, mem, name in devices:
        by_host.setdefault(host, []).append((int(mem or DEFAULT_DEVICE_MEM), name))
    cluster = [NodeSpec(h, len(d), min(m for m, _ in d), d[0][1]) for h, d in sorted(by_host.items())] or None
    return Trace("store", jobs, cluster, report, {})
