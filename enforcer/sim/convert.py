"""How a simulator job asks the enforcer's lanes for memory: SimJob -> enforcer.lanes.Job (P, E, util)."""

from __future__ import annotations

import math

from enforcer.lanes import Job
from enforcer.sim.model import SimJob
from store.headroom import LANE_FACTOR, PERSISTENT_FACTOR

# openb pods are sized by a compute share, not bytes: their lane is that share of this nominal device memory
QUOTA_DEVICE_MEM = 32 * 1024**3


def to_lane_job(job: SimJob, *, exclusive: bool = False, quota_device_mem: int = QUOTA_DEVICE_MEM) -> Job:
    """The lanes' view of a job.

    - Salus-style jobs carry P and E; jobs with only a peak (serving containers, the store's jobs without a
      memory profile) hold all of it for good, so P = peak, E = 0.
    - quota jobs (mem None, openb) get P such that Salus's lane of 1.05 x 1.1 P is the share of the device, so
      one pod per lane and lanes add up like gpu_milli does; a pod of a whole device (share 1) is exclusive.
    - context (C, enforcer.lanes) is 0: a trace's memory is what the device showed of the job (Alibaba's containers
      read device memory used, which counts the CUDA context and workspaces; openb's quota is a share of the
      device, whatever it holds), so charging the default on top would count the contexts twice.
    """
    if job.mem is None:
        if job.share >= 1.0 or job.gpus > 1:
            persistent, ephemeral, exclusive = 0, 0, True
        else:
            persistent = int(math.floor(job.share * quota_device_mem / (LANE_FACTOR * PERSISTENT_FACTOR))) - 2
            ephemeral = 0
    elif job.mem_persistent is not None and job.mem_ephemeral is not None:
        persistent, ephemeral = job.mem_persistent, job.mem_ephemeral
    else:
        persistent, ephemeral = job.mem, 0
    if job.mem is not None and job.mem <= quota_device_mem < math.ceil(PERSISTENT_FACTOR * persistent) + ephemeral:
        # it fits a device alone, only not with Salus's headroom: it gets a device whole, nobody joins; P is
        # scaled so that the whole-device check (1.1 P <= capacity) still refuses devices smaller than its memory
        persistent, ephemeral, exclusive = int(job.mem / PERSISTENT_FACTOR), 0, True
    return Job(
        job_id=job.id,
        persistent=max(0, persistent),
        ephemeral=max(0, ephemeral),
        util=job.demand(),
        gpus=job.gpus,
        exclusive=exclusive or job.gpus > 1,
        arrival=job.arrival,
        attained_s=0.0,
        remaining_s=job.work,
        context=0,
    )
