"""FAIR: spread jobs over the least loaded devices, and inside a lane the job with the least attained device time
takes the next iteration (Salus's fair policy)."""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from enforcer.discipline import LEAST_ATTAINED
from enforcer.lane_fleet import Fleet
from enforcer.lanes import Job
from enforcer.policies.base import Policy


class Fair(Policy):
    name: ClassVar[str] = "fair"
    lane_order: ClassVar[str] = LEAST_ATTAINED
    description: ClassVar[str] = "spread over the least loaded devices; least attained device time goes next"

    def score_all(self, job: Job, fleet: Fleet) -> np.ndarray:
        a = fleet.arrays
        # least compute demand first, then fewest jobs, then most memory unused
        return -a.demand - a.n_jobs * 1e-3 + a.slack * 1e-6

    def score_hosts(self, hosts: np.ndarray, free_counts: np.ndarray) -> np.ndarray:
        return free_counts.astype(np.float64) - hosts * 1e-9

    def priority(self, job: Job) -> tuple[float, ...]:
        return (job.attained_s,)
