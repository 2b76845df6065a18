"""The thin layer between the simulator and the enforcer's policies: the same `Policy` objects place and order
jobs; this only translates the simulator's job states to the `enforcer.lanes.Job`s the policies read."""

from __future__ import annotations

import math
from typing import Any

from enforcer.lane_fleet import Fleet
from enforcer.lanes import Admission, Job
from enforcer.policies import Policy, get_policy
from enforcer.sim.tiresias import TiresiasScheduler


class EnforcerPolicy:
    """An enforcer `Policy` driven by the simulator.

    one_lane: every device is one lane of all its memory that its jobs take turns in (Salus's single-GPU SRTF and
    FIFO runs: all jobs resident, one runs at a time, the policy picks it at each iteration). The policy still
    chooses the device and the lane rule admits: the first job's new lane is widened to the whole device, and
    later jobs join it when P' + max(E, the lane's largest E) fits, else they wait.
    """

    def __init__(self, policy: Policy, *, one_lane: bool = False) -> None:
        self.policy = policy
        self.name = policy.name + ("/1-lane" if one_lane else "")
        self.exclusive = policy.exclusive
        # how jobs of one lane take turns: the live gate's rule (enforcer.discipline)
        self.lane_discipline = policy.lane_order
        self.one_lane = one_lane
        self.preemptive = False

    def queue_order(self, waiting: list) -> list:
        by_job = {id(s.job): s for s in waiting}
        return [by_job[id(j)] for j in self.policy.queue_order([s.job for s in waiting])]

    def pick_next(self, jobs: list[Job]) -> Job | None:
        return self.policy.pick_next(jobs)

    def priority(self, job: Job) -> tuple:
        return self.policy.priority(job)

    def place(self, fleet: Fleet, job: Job) -> list[Admission] | None:
        placed = self.policy.place(job, fleet)
        if not self.one_lane or placed is None or len(placed) != 1 or not placed[0].new_lane or placed[0].exclusive:
            return placed
        adm = placed[0]
        device = fleet.devices[fleet.index_of[adm.device_id]]
        if not device.lanes:
            # the device's one lane is all of its memory, as in Salus's single-lane runs
            return [Admission(job.job_id, adm.device_id, None, device.capacity, adm.p_prime, adm.ephemeral)]
        lane = next(iter(device.lanes.values()))
        if lane.fits(adm.p_prime, adm.ephemeral):
            return [Admission(job.job_id, adm.device_id, lane.lane_id, lane.size, adm.p_prime, adm.ephemeral)]
        return None


def make_policy(name: str, *, one_lane: bool = False, **options: Any) -> Any:
    """A simulator policy by name: the enforcer's (fifo, pack, fair, srtf, via get_policy) or tiresias."""
    key = str(name).strip().lower()
    if key == "tiresias":
        return TiresiasScheduler(**{k: v for k, v in options.items() if k in ("thresholds", "migration_cost_s")})
    opts = {k: v for k, v in options.items() if k in ("model", "max_slowdown")}
    if one_lane:
        # jobs in one lane take turns: the one running is not slowed by the others, so no slowdown cap applies
        opts.setdefault("max_slowdown", math.inf)
    return EnforcerPolicy(get_policy(key, **opts), one_lane=one_lane)
