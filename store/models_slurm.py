"""The schema of Slurm: what Slurm last said of each job it runs."""

from __future__ import annotations

from typing import Any

from sqlalchemy import BigInteger, Boolean, ForeignKey, Integer, String, Text, text
from sqlalchemy.orm import Mapped, mapped_column

from store.models_base import Base

GONE = "GONE"  # the state of a job squeue no longer lists


class SlurmJob(Base):
    """What Slurm last said of one job (collector.importers.slurm): its request, what it holds, and whether it opted
    in to be moved. The workflow `slurm-<id>` is the same id the agent gives the job's processes.

    What it holds is `gpus_by_node`, every node's GPUs (a job may run on several nodes). `node` and `gpu_indices` are
    its batch script's node and its GPUs there, all of them for a job on one node: kept as they were before jobs on
    several nodes were recorded, for the code that reads them (the Slurm actuator moves only one-node jobs)."""

    __tablename__ = "slurm_jobs"

    workflow_id: Mapped[str] = mapped_column(ForeignKey("workflows.id", ondelete="CASCADE"), primary_key=True)
    job_id: Mapped[int] = mapped_column(BigInteger, index=True)
    # its first submission fleetlens saw (a requeue gives it a new one): with the id and the restart count, tells a
    # job from a later one that reuses its id
    submit_time: Mapped[float]
    # when its current run began (squeue's start_time, else when the import first saw it hold its GPUs), while it
    # holds them (alembic revision 0014); None else
    start_time: Mapped[float | None]
    name: Mapped[str | None] = mapped_column(String(255))
    user: Mapped[str | None] = mapped_column(String(255))
    account: Mapped[str | None] = mapped_column(String(255))
    partition: Mapped[str | None] = mapped_column(String(255))
    state: Mapped[str] = mapped_column(String(32))  # Slurm's job_state: PENDING, RUNNING, ...
    reason: Mapped[str | None] = mapped_column(Text)  # Slurm's state_reason (held, waiting for resources, ...)
    node: Mapped[str | None] = mapped_column(String(255))  # the batch script's node
    time_limit_s: Mapped[float | None]  # None: no limit
    gres: Mapped[str | None] = mapped_column(String(255))  # the request, e.g. "shard:2" or "gpu:1"
    gpus: Mapped[int] = mapped_column(Integer, default=0)  # whole GPUs requested
    shards: Mapped[int] = mapped_column(Integer, default=0)  # shards requested
    gpu_indices: Mapped[list[Any]] = mapped_column(default=list)  # the GPUs it holds on `node` (either way)
    # [[node, [GPU index, ...]], ...] sorted by node: the GPUs it holds on every node, [] while it holds none
    gpus_by_node: Mapped[list[Any]] = mapped_column(default=list, server_default=text("'[]'"))
    requeue: Mapped[bool] = mapped_column(Boolean, default=False)
    restart_count: Mapped[int] = mapped_column(Integer, default=0)
    comment: Mapped[str | None] = mapped_column(Text)
    opted_in: Mapped[bool] = mapped_column(Boolean, default=False)
    not_movable_reason: Mapped[str | None] = mapped_column(Text)  # why it is observed and advised only
    seen_at: Mapped[float] = mapped_column(index=True)
