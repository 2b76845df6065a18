"""Slurm jobs that hold GPUs on a node whose agent sees no process of theirs there: a finding of its own (the GPUs
are allocated and nothing runs on them: a job stuck before its first CUDA call, or one whose work ended while its
batch script waits). Only nodes with a live agent are judged: without one nobody could have seen a process."""

from __future__ import annotations

import time

from sqlalchemy import select

from store.db import Store
from store.findings import FindingSpec, upsert_findings
from store.models import Host, Process, Workflow
from store.models_slurm import SlurmJob
from store.slurm import shard_share, shards_by_gpu

RULE = "slurm_gpus_without_process"


def find_slurm_holders_without_processes(store: Store, *, now: float | None = None, grace_s: float = 300.0,
                                         agent_max_age_s: float = 120.0) -> int:
    """Record one finding per running Slurm job whose run started `grace_s` ago or more (not counting its time in the
    queue), holding GPUs on a node whose agent wrote within `agent_max_age_s`, with no live process of it there;
    returns how many. A job on several nodes is judged on each of them (the import keeps every node's GPUs in the
    row's `gpus_by_node`), and one finding names the nodes where its GPUs sit idle. Its GPU-hours are those GPUs'
    worth: whole GPUs, or a shard job's share of each."""
    now = time.time() if now is None else now
    specs: list[FindingSpec] = []
    with store.session() as session:
        jobs = list(session.scalars(
            select(SlurmJob).join(Workflow, Workflow.id == SlurmJob.workflow_id)
            # the grace counts from the start of the job's current run, not from its first import (often while it
            # waited in the queue); a row without its start (written before revision 0014) waits for the next import
            .where(SlurmJob.state == "RUNNING", SlurmJob.node.is_not(None), SlurmJob.start_time <= now - grace_s)))
        held = {job.workflow_id: {str(n): [int(i) for i in ix] for n, ix in job.gpus_by_node or []} for job in jobs}
        nodes = {n for on in held.values() for n in on}
        watched = set(session.scalars(select(Host.id).where(Host.id.in_(nodes), Host.source != "slurm",
                                                            Host.last_seen >= now - agent_max_age_s)))
        spread = {h.id: shards_by_gpu(int(((h.labels or {}).get("slurm") or {}).get("gpus") or 0),
                                      int(((h.labels or {}).get("slurm") or {}).get("shards") or 0))
                  for h in session.scalars(select(Host).where(Host.id.in_(watched)))}
        running = set(session.execute(select(Process.workflow_id, Process.host_id).where(
            Process.host_id.in_(watched), Process.ended_at.is_(None))).tuples())
        for job in jobs:
            idle = {n: ix for n, ix in held[job.workflow_id].items()
                    if n in watched and ix and (job.workflow_id, n) not in running}
            if not idle:
                continue
            held_gpus = sum(_held(job, ix, spread.get(n, ())) for n, ix in idle.items())
            where = ", ".join(f"GPU {','.join(str(i) for i in ix)} of {n}" for n, ix in sorted(idle.items()))
            first = sorted(idle)[0]
            specs.append(FindingSpec(
                rule=RULE, workflow_id=job.workflow_id, source="telemetry", severity="high",
                title=f"Slurm job {job.job_id} holds {where} ({job.gres}) with no process on it",
                fix=(f"find out why job {job.job_id} runs nothing (stuck before its first GPU call, or its script "
                     "waits after its work ended) and end it (scancel) or fix it; its GPUs are idle meanwhile"),
                evidence={"job_id": job.job_id, "node": first if len(idle) == 1 else job.node, "gres": job.gres,
                          "gpu_indices": list(idle[first]) if len(idle) == 1 else job.gpu_indices,
                          "idle_gpus_by_node": {n: list(ix) for n, ix in idle.items()}},
                location=f"slurm job {job.job_id} on {','.join(sorted(idle))}",
                gpu_hours_per_day=24.0 * held_gpus))
        upsert_findings(session, specs, now)
    return len(specs)


def _held(job: SlurmJob, indices: list[int], spread: tuple[int, ...]) -> float:
    """How many GPUs' worth `job` holds in `indices` of one node whose GPUs have `spread` shards each: whole GPUs, or
    a shard job's share of each of its GPUs by that GPU's own shards (as the import counts it; a whole GPU where the
    node's shards are not known)."""
    if job.gpus:
        return float(len(indices))
    if not job.shards:
        return 0.0
    return sum(shard_share(job.shards, len(indices), spread[i]) if 0 <= i < len(spread) and spread[i] else 1.0
               for i in indices)

