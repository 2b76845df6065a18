"""PACK: fewest devices. Best fit by memory (busy devices first, least free memory), arrival order in a lane, and
no device filled past the point where the co-location model expects anyone on it to slow down by more than the cap.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from enforcer.discipline import ROUND_ROBIN
from enforcer.lane_fleet import Fleet
from enforcer.lanes import Job
from enforcer.policies.base import Policy


class Pack(Policy):
    name: ClassVar[str] = "pack"
    lane_order: ClassVar[str] = ROUND_ROBIN
    description: ClassVar[str] = "fewest devices: best fit by memory, compute capped by co-location slowdown"
    cap_slowdown: ClassVar[bool] = True

    def score_all(self, job: Job, fleet: Fleet) -> np.ndarray:
        a = fleet.arrays
        # busy devices first, then the one that would leave the least memory unused (free + lane room)
        return np.where(a.n_jobs > 0, 4.0, 0.0) - a.slack

    def score_hosts(self, hosts: np.ndarray, free_counts: np.ndarray) -> np.ndarray:
        # the host with the fewest empty devices that still has enough: keeps whole hosts free for big jobs
        return -free_counts.astype(np.float64) - hosts * 1e-9
