"""Slurm's view in the store: each cycle, read the jobs (`squeue --json`) and nodes (`sinfo --json`) and record them.

A job becomes the workflow `slurm-<id>` (the id the agent gives its processes through SLURM_JOB_ID) with its team
(its account or partition, FLEETLENS_SLURM_TEAM_FROM, renamed by FLEETLENS_SLURM_TEAMS), and a `slurm_jobs` row with
its request, time limit, the GPUs it holds and whether it opted in to be moved (its --comment, or its fleetlens
SDK's start mark in its checkpoint location: store.slurm_marks). A node becomes a host, its GPUs devices (source
"slurm"; a node whose agent registered its GPUs keeps them; the host's labels keep the node's state as Slurm gives
it, which store.registry reads: a node Slurm reports down or not responding is not heard from, and one drained,
draining, in maintenance or reserved takes no move), and a running job's GPUs placements, one per GPU on
every node the job runs on (a shard job's compute share is its shards over the GPU's). The row's `gpus_by_node`
and the workflow's label `slurm_gpus` keep every node's GPUs (the same value), the row's `node` and `gpu_indices`
the batch script's node and its GPUs there (all of them for a job on one node), and the workflow's `gpus` counts the
whole GPUs held on all of them. A Slurm job is never `managed` in the agents' sense: only the Slurm actuator moves
it, and only when `slurm_jobs.opted_in` says so.

Bad input is refused per job where it can be: a gres it cannot read leaves the job observed without GPUs and never
movable; a node whose gres it cannot read is left out, with the reason, and the other nodes are read; a job id Slurm
reused (slurmctld lost its state) leaves the new job out, with the reason. squeue missing or failing, or JSON of
another Slurm version, raises before anything is written.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from store.db import Store
from store.errors import InvalidInput
from store.models import Device, Host, Placement, Workflow
from store.models_slurm import GONE
from store.models_slurm import SlurmJob as SlurmJobRow
from store.registry import DeviceSpec, register_devices, register_host
from store.rows import merge_labels
from store.settings import Settings
from store.slurm import (
    HOLDING_STATES,
    WAITING_STATES,
    SdkAsked,
    SlurmJob,
    SlurmNode,
    SlurmView,
    parse_jobs,
    parse_nodes,
    shard_share,
)
from store.slurm_cli import SlurmCli
from store.slurm_marks import StartMarks, first_submits, sdk_asked_from, signal_unsafe
from store.slurm_nodes import node_label
from store.workflows import upsert_workflow

log = logging.getLogger(__name__)

SOURCE = "slurm"


@dataclass
class SlurmImport:
    version: str
    nodes: int = 0
    jobs: int = 0
    opted_in: int = 0
    errors: list[str] = field(default_factory=list)  # jobs left out or read in part, and why


def read_view(cli: SlurmCli, sdk_asked: SdkAsked | None = None) -> SlurmView:
    """One reading of the cluster through its CLI (raises UpstreamUnavailable / InvalidInput, writing nothing);
    `sdk_asked` reads whether a job's SDK asked to be movable (its start mark, store.slurm_marks)."""
    version, jobs = parse_jobs(cli.json("squeue"), sdk_asked=sdk_asked)
    errors: list[str] = []  # nodes left out (a gres that cannot be read), reported with the import's other errors
    _, nodes = parse_nodes(cli.json("sinfo"), errors=errors)
    return SlurmView(version=version, nodes=nodes, jobs=jobs, errors=errors)


def import_slurm(store: Store, settings: Settings, *, cli: SlurmCli | None = None,
                 now: float | None = None) -> SlurmImport:
    """Read the cluster and record it (one transaction)."""
    marks = StartMarks(settings)  # each job's start mark read once, for its opt-in and its signal safety
    view = read_view(cli or SlurmCli.from_settings(settings),
                     sdk_asked_from(settings, marks, first_submits=first_submits(store)))
    return record_view(store, view, settings, now=time.time() if now is None else now, marks=marks)


def import_slurm_from_settings(store: Store, settings: Settings) -> dict[str, Any]:
    """The serve job and the DAG task: import when FLEETLENS_SLURM is on."""
    if not settings.slurm:
        return {"skipped": "FLEETLENS_SLURM is not set"}
    result = import_slurm(store, settings)
    return {"version": result.version, "nodes": result.nodes, "jobs": result.jobs, "opted_in": result.opted_in,
            "errors": result.errors}


def record_view(store: Store, view: SlurmView, settings: Settings, *, now: float,
                marks: StartMarks | None = None) -> SlurmImport:
    """Record one reading of the cluster in one transaction; `marks`: the start marks read for that reading."""
    marks = marks or StartMarks(settings)
    result = SlurmImport(version=view.version, nodes=len(view.nodes), errors=list(view.errors))
    with store.session() as session:
        devices = {name: _node_devices(session, node, now) for name, node in view.nodes.items()}
        seen: set[str] = set()
        for job in view.jobs.values():
            reused = _reused(session, job)
            if reused is not None:
                result.errors.append(reused)
                continue
            if job.gres_error:
                result.errors.append(f"slurm job {job.job_id}: {job.gres_error}")
            job = _unless_signal_unsafe(job, marks)
            _record_job(session, job, settings, devices, view, now)
            seen.add(job.workflow_id)
            result.jobs += 1
            result.opted_in += job.opted_in
        _forget_gone(session, seen, now)
    for error in result.errors:
        log.warning("%s", error)
    return result


def _unless_signal_unsafe(job: SlurmJob, marks: StartMarks) -> SlurmJob:
    """An opted-in job whose own start mark says the checkpoint signal would kill it (its SDK is not the batch step's
    process) is recorded as not movable, with the reason, so that no cycle plans a move the actuator must refuse. A
    job with no mark yet stays as it is: the actuator waits for its mark before it signals."""
    if not job.opted_in:
        return job
    try:
        started = marks.started(job.workflow_id)
    except (InvalidInput, OSError) as exc:
        log.warning("slurm job %s: its start mark cannot be read (%s)", job.job_id, exc)
        return job
    unsafe = signal_unsafe(started) if started is not None and started.job_id == job.job_id else None
    if unsafe is None:
        return job
    return replace(job, opted_in=False, not_movable_reason=(
        f"opted in, but {unsafe}: the checkpoint signal would kill it; start it with `exec python train.py` in the "
        "batch script"))


def _node_devices(session: Session, slurm_node: SlurmNode, now: float) -> dict[int, int]:
    """{GPU index: device id}: the node's agent's devices when it has registered them, else the GPUs Slurm names.
    The host's labels keep what Slurm says of the node (its GPUs, shards and partitions, and its state: its base
    state, flags and reason, which decide whether it is heard from and takes moves, store.slurm_nodes)."""
    node, gpus = slurm_node.name, slurm_node.gpus
    labels = {"slurm": {"gpus": gpus, "shards": slurm_node.shards, "partitions": list(slurm_node.partitions),
                        **node_label(slurm_node.state, slurm_node.flags, slurm_node.reason)}}
    host = session.get(Host, node)
    if host is None:
        register_host(session, node, hostname=node, source=SOURCE, labels=labels, now=now)
    else:
        host.labels = {**(host.labels or {}), **labels}
    known = {d.index: d for d in session.scalars(select(Device).where(Device.host_id == node))}
    if known and any(d.source != SOURCE for d in known.values()):
        # the node's agent registered its devices: its GPUs (NVML indices are Slurm's), or no GPU at all (a cpu
        # source's core groups, which are not the GPUs Slurm hands out: the jobs then get no placements)
        return {i: d.id for i, d in known.items() if d.source == "nvml"}
    specs = [DeviceSpec(index=i, uuid=f"slurm:{node}:gpu{i}", name=f"Slurm GPU {i} of {node}", memory_total=None)
             for i in range(gpus)]
    return register_devices(session, node, specs, source=SOURCE, now=now)


def _reused(session: Session, job: SlurmJob) -> str | None:
    """Why `job` is not the job the store knows under its id (None: it is, or the store knows none). The row keeps the
    job's first submission fleetlens saw. A requeue gives the job a new submit time and counts a restart, and squeue
    shows the two at different moments (the restart at once, while the job is still COMPLETING; the submit time
    about 2 s later), so a job with a new submit time is the same one while it counts at least one restart and no
    fewer than the store saw. A job whose count is back at 0 (or below the store's) with a new submit time is a new
    job under a reused id; so is any job under the id of one the store saw end."""
    row = session.get(SlurmJobRow, job.workflow_id)
    if row is None or abs(row.submit_time - job.submit_time) < 1.0:
        return None
    if row.state != GONE and job.restart_count > 0 and job.restart_count >= row.restart_count:
        return None
    return (f"slurm job id {job.job_id} was reused: the store's {job.workflow_id} was submitted at "
            f"{row.submit_time:.0f} by {row.user} ({row.name}), the job Slurm now calls {job.job_id} at "
            f"{job.submit_time:.0f} by {job.user} "
            f"({job.name}); slurmctld restarted without its state, so its ids began again. fleetlens keeps the old "
            f"record and leaves the new job unobserved and never moved; delete workflow {job.workflow_id} from the "
            "store to observe it")


def _team(job: SlurmJob, settings: Settings) -> str | None:
    key = (job.account if settings.slurm_team_from == "account" else job.partition) or job.partition or job.account
    return settings.slurm_teams.get(key, key) if key else None


def _record_job(session: Session, job: SlurmJob, settings: Settings, devices: dict[str, dict[int, int]],
                view: SlurmView, now: float) -> None:
    """The job's workflow, row and placements. `devices`: {node: {GPU index: device id}} of every node."""
    running = job.state in HOLDING_STATES
    whole = job.gres is not None and job.gres.kind == "gpu"
    # whole GPUs on all its nodes (a --gres=gpu:2 job on two nodes holds 4); what it asked for while it holds none
    gpus = (job.gpus_held if running and job.gpus_held else job.gres.count) if whole and job.gres else 0
    workflow = upsert_workflow(session, job.workflow_id, now=now, id_source="slurm", name=job.name, owner=job.user,
                               team=_team(job, settings), gpus=gpus,
                               state="running" if running or job.state in WAITING_STATES else _final(job.state))
    # [[node, [GPU index, ...]], ...]: a list, so that it is merged into the labels in SQL as one value (store.rows)
    held = sorted([node, list(indices)] for node, indices in job.gpus_by_node.items()) if running else []
    if (workflow.labels or {}).get("slurm_gpus") != held:
        merge_labels(session, workflow, {"slurm_gpus": held})
    row = session.get(SlurmJobRow, job.workflow_id)
    if row is None:
        row = SlurmJobRow(workflow_id=job.workflow_id, job_id=job.job_id, submit_time=job.submit_time)
        session.add(row)
    held_before = row.state in HOLDING_STATES
    row.name, row.user, row.account, row.partition = job.name, job.user, job.account, job.partition
    row.state, row.reason, row.node, row.time_limit_s = job.state, job.reason, job.node, job.time_limit_s
    # when its current run began: squeue's start_time, else when the import first saw it hold its GPUs
    row.start_time = (job.start_time or (row.start_time if held_before else None) or now) if running else None
    row.gres = str(job.gres) if job.gres else None
    row.gpus = job.gres.count if job.gres and job.gres.kind == "gpu" else 0
    row.shards = job.gres.count if job.gres and job.gres.kind == "shard" else 0
    row.gpu_indices = list(job.gpu_indices) if running else []
    row.gpus_by_node = held
    row.requeue, row.restart_count, row.comment = job.requeue, job.restart_count, job.comment
    row.opted_in, row.not_movable_reason, row.seen_at = job.opted_in, job.not_movable_reason, now
    shares: dict[int, tuple[str, float]] = {}
    if running and job.gres is not None and not job.gres_error:
        for name, indices in job.gpus_by_node.items():  # every node of the job, its own GPUs and shards each
            node, on_node = view.nodes.get(name), devices.get(name, {})
            for i in indices:
                of_gpu = node.shards_on(i) if node else 0  # a node's GPUs may have different numbers of shards
                if i in on_node:
                    shares[on_node[i]] = (name, 1.0 if job.gres.kind == "gpu" or not of_gpu else shard_share(
                        job.gres.count, len(indices), of_gpu))
    _place(session, job.workflow_id, shares, now)


def _final(state: str) -> str:
    return "finished" if state == "COMPLETED" else "failed"


def _place(session: Session, workflow_id: str, shares: dict[int, tuple[str, float]], now: float) -> None:
    """The job's active placements are exactly its GPUs now, on whichever of its nodes each is ({device id: (host,
    compute share)}): new ones opened, others ended."""
    open_rows = {p.device_id: p for p in session.scalars(select(Placement).where(
        Placement.workflow_id == workflow_id, Placement.state == "active"))}
    for device_id, row in open_rows.items():
        if device_id not in shares:
            row.state, row.ended_at = "ended", now
        else:
            row.compute_share = shares[device_id][1]
    for device_id, (host, share) in shares.items():
        if device_id not in open_rows:
            session.add(Placement(workflow_id=workflow_id, device_id=device_id, host_id=host, compute_share=share,
                                  state="active", started_at=now))


def _forget_gone(session: Session, seen: set[str], now: float) -> None:
    """Jobs squeue no longer lists have ended: their placements end, their rows say so."""
    for row in session.scalars(select(SlurmJobRow).where(SlurmJobRow.state != GONE)):
        if row.workflow_id in seen:
            continue
        row.state, row.gpu_indices, row.gpus_by_node = GONE, [], []
        wf = session.get(Workflow, row.workflow_id)
        if wf is not None and wf.state == "running":
            wf.state = "finished"
        if wf is not None and (wf.labels or {}).get("slurm_gpus"):
            merge_labels(session, wf, {"slurm_gpus": []})
        _place(session, row.workflow_id, {}, now)
