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

RULE = "slurm_gpus_without_process"


def find_slurm_holders_without_processes(store: Store, *, now: float | None = None, grace_s: float = 300.0,
                                         agent_max_age_s: float = 120.0) -> int:
    """Record one finding per running Slurm job that has held GPUs for `grace_s` on a node whose agent wrote within
    `agent_max_age_s`, with no live process of it there; returns how many."""
    now = time.time() if now is None else now
    specs: list[FindingSpec] = []
    with store.session() as session:
        jobs = list(session.execute(
            select(SlurmJob, Workflow.created_at).join(Workflow, Workflow.id == SlurmJob.workflow_id)
            .where(SlurmJob.state == "RUNNING", SlurmJob.node.is_not(None), Workflow.created_at <= now - grace_s)))
        nodes = {r.node for r, _ in jobs}
        watched = set(session.scalars(select(Host.id).where(Host.id.in_(nodes), Host.source != "slurm",
                                                            Host.last_seen >= now - agent_max_age_s)))
        running = set(session.execute(select(Process.workflow_id, Process.host_id).where(
            Process.host_id.in_(watched), Process.ended_at.is_(None))).tuples())
        for job, _created in jobs:
            if job.node not in watched or not job.gpu_indices or (job.workflow_id, job.node) in running:
                continue
            gpus = job.gpus or job.shards  # whole GPUs, or shards as their GPUs' share below
            held = ",".join(str(i) for i in job.gpu_indices)
            specs.append(FindingSpec(
                rule=RULE, workflow_id=job.workflow_id, source="telemetry", severity="high",
                title=f"Slurm job {job.job_id} holds GPU {held} of {job.node} ({job.gres}) with no process on it",
                fix=(f"find out why job {job.job_id} runs nothing (stuck before its first GPU call, or its script "
                     "waits after its work ended) and end it (scancel) or fix it; its GPUs are idle meanwhile"),
                evidence={"job_id": job.job_id, "node": job.node, "gres": job.gres, "gpu_indices": job.gpu_indices},
                location=f"slurm job {job.job_id} on {job.node}",
                gpu_hours_per_day=24.0 * (len(job.gpu_indices) if job.gpus else 1.0) if gpus else 0.0))
        upsert_findings(session, specs, now)
    return len(specs)
