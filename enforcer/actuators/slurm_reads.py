"""What Slurm says now, read for a move of a Slurm job (enforcer.actuators.slurm decides each step from it).

One job as squeue shows it, its opt-in read from its start mark; whether its node takes a move now and has a GPU
with room for the new request; who holds the GPUs the job was given; and how a request and a state reason read.
Every call asks the Slurm CLI afresh (never the last import's row) and changes nothing, in Slurm or in the store.
"""

from __future__ import annotations

from store.db import Store
from store.errors import UpstreamUnavailable
from store.settings import Settings
from store.slurm import HOLDING_STATES, Gres, SlurmJob, free_shards, parse_jobs, parse_nodes
from store.slurm_cli import SlurmCli, SlurmRefused
from store.slurm_marks import first_submits, sdk_asked_from
from store.slurm_nodes import no_move_reason, node_label


def read_job(cli: SlurmCli, store: Store, settings: Settings, job_id: int) -> SlurmJob | None:
    """What Slurm says of one job now, with its opt-in read from its start mark. squeue 22.05 lists every job
    whatever `--jobs` says, so the others are dropped before they are read: one start mark per step, not one per
    job in the queue."""
    try:
        doc = cli.json("squeue", f"--jobs={job_id}")
    except SlurmRefused as exc:
        if "invalid job id" in str(exc).lower():
            return None
        raise
    mine = [j for j in doc.get("jobs") or [] if isinstance(j, dict) and str(j.get("job_id")) == str(job_id)]
    # the job's first submission as the store saw it: its own mark from before a requeue still counts while
    # the run after it has not written its own yet
    asked = sdk_asked_from(settings, first_submits=first_submits(store, [job_id]))
    _, jobs = parse_jobs({**doc, "jobs": mine},
                         sdk_asked=lambda j, submit, restart: j == job_id and asked(j, submit, restart))
    return jobs.get(job_id)


def node_room(cli: SlurmCli, job_id: int, node_name: str | None, shards: int) -> str | None:
    """Why the node has no GPU left with `shards` free beside the job's own, or takes no new job now (down, not
    responding, drained, draining, in maintenance, reserved: store.slurm_nodes), as sinfo says now (None when it
    has such a GPU and takes jobs). Raises
    UpstreamUnavailable while Slurm does not know the node's shards (slurmd not registered again after a restart
    of slurmctld): the move waits rather than rolls back on a half-known node."""
    _, jobs = parse_jobs(cli.json("squeue"))
    _, nodes = parse_nodes(cli.json("sinfo"))
    node = nodes.get(node_name or "")
    if node is None:
        return f"node {node_name} is not in sinfo"
    if (why := no_move_reason(node_label(node.state, node.flags, node.reason))) is not None:
        return f"node {node.name} takes no move now: {why}"  # the requeued job could not start there again
    if node.gpus and not node.shards:
        raise UpstreamUnavailable(f"Slurm does not say yet how many shards node {node.name} has (state "
                                  f"{node.state})")
    free = free_shards(node, jobs, leaving=job_id)
    if any(n >= shards for n in free.values()):
        return None
    holders = {j.job_id: f"{j.gres}@{list(j.gpus_on(node.name))}" for j in jobs.values()
               if j.gpus_on(node.name) and j.state in HOLDING_STATES and j.job_id != job_id}
    return (f"no free shard is left on {node.name}: no GPU there has {shards} shards free that no whole-GPU job "
            f"holds (free per GPU {free}; held by jobs {holders})")


def whole_holders(cli: SlurmCli, job: SlurmJob) -> list[int]:
    """The running whole-GPU jobs on one of the GPUs `job` was given."""
    _, jobs = parse_jobs(cli.json("squeue"))
    return sorted(j.job_id for j in jobs.values() if j.job_id != job.job_id and job.node is not None
                  and j.state == "RUNNING" and j.gres is not None and j.gres.kind == "gpu"
                  and set(j.gpus_on(job.node)) & set(job.gpu_indices))


def why_not_fewer(new: Gres | None, live: Gres | None) -> str | None:
    """Why `new` is not a smaller request than `live`, the one Slurm shows the job holding now (None: it is). A move
    only ever lowers a shard request; a whole-GPU request is not one fleetlens changes (Slurm 22.05 cannot)."""
    if new is None or new.kind != "shard":
        return f"the move asks for {new}, not shards"
    if live is None or live.kind != "shard":
        return f"the job's request is {live}, not shards, and fleetlens only lowers a shard request"
    if new.count >= live.count:
        return f"{new} is not fewer shards than {live}, and fleetlens never raises a request"
    return None


def is_held(reason: str | None) -> bool:
    """Whether Slurm's state_reason says the job is held (by its user, an admin, or a requeuehold)."""
    return (reason or "").lower().startswith(("jobheld", "job requeued in held"))
