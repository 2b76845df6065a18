"""The one small interface every policy implements: placement (filter -> score -> bind) and in-lane ordering.

Placement follows the Kubernetes scheduling framework over a `Fleet`: `filter` keeps the devices that may take the
job (numpy positions), `score` ranks them (higher is better; subclasses give `score_all`, one vectorised pass over
every device, which `place` combines with the filter's mask), and `bind` turns the best into an
`Admission` under Salus's lane rule (a new lane, or the fitting lane with least room), trying the next device when
the exact check refuses. `place` runs the three without changing the fleet; `assign` also carries the result out.

Ordering (Gavel-style): `priority(job)` is a sort key, lowest first. It decides which job of a lane takes the next
iteration (`pick_next`) and which waiting job is considered first (`queue_order`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import numpy as np

from enforcer.discipline import JOB_ORDER
from enforcer.interference import InterferenceModel, default_model
from enforcer.lane_fleet import Fleet
from enforcer.lanes import Admission, Job

DEFAULT_MAX_SLOWDOWN = 1.5


class Policy:
    """Base policy: first fit by memory in lanes, jobs in arrival order. Subclasses override score_all / priority."""

    name: ClassVar[str] = "base"
    lane_order: ClassVar[str] = JOB_ORDER  # how a lane's jobs take steps (enforcer.discipline)
    description: ClassVar[str] = ""
    exclusive: ClassVar[bool] = False  # True: every job gets whole devices (no sharing)
    cap_slowdown: ClassVar[bool] = False  # True: refuse devices where anyone's expected slowdown passes the cap

    def __init__(self, model: InterferenceModel | None = None, max_slowdown: float = DEFAULT_MAX_SLOWDOWN) -> None:
        self.model = model if model is not None else default_model()
        self.max_slowdown = max_slowdown
        self._max_load: dict[float, float] = {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(max_slowdown={self.max_slowdown})"

    # ---- placement
    def whole(self, job: Job) -> bool:
        return self.exclusive or job.whole_devices

    def filter(self, job: Job, fleet: Fleet) -> np.ndarray:
        """Positions of devices that may take the job."""
        return np.flatnonzero(self.filter_mask(job, fleet))

    def filter_mask(self, job: Job, fleet: Fleet) -> np.ndarray:
        """`filter` as a boolean mask over all device positions (the fast path `place` uses)."""
        mask = fleet.candidate_mask(job, whole=self.whole(job))
        if self.cap_slowdown and not self.whole(job):
            a = fleet.arrays
            mask &= (a.n_jobs == 0) | (a.demand <= self.max_load(job.util))
        return mask

    def score(self, job: Job, fleet: Fleet, idx: np.ndarray) -> np.ndarray:
        """Scores of the devices at positions `idx`: higher is better; ties go to the lower position."""
        return self.score_all(job, fleet)[idx]

    def score_all(self, job: Job, fleet: Fleet) -> np.ndarray:
        """Scores of every device (one vectorised pass; subclasses override this). Base: first fit."""
        return -np.arange(len(fleet), dtype=np.float64)

    def bind(self, job: Job, fleet: Fleet, i: int) -> Admission | None:
        """The exact admission on device position i (None if it refuses after all)."""
        adm = fleet.admit(i, job, whole=self.whole(job))
        if adm is not None and self.cap_slowdown and not adm.exclusive:
            if self.expected_slowdown(job, fleet, adm) > self.max_slowdown:
                return None
        return adm

    def place(self, job: Job, fleet: Fleet) -> list[Admission] | None:
        """Where the job would go (one admission per device), or None if it must wait. The fleet is unchanged."""
        if len(fleet) == 0:
            return None
        if job.gpus > 1:
            return self._place_gang(job, fleet)
        mask = self.filter_mask(job, fleet)
        scores = np.where(mask, self.score_all(job, fleet), -np.inf)
        best = int(np.argmax(scores))
        if not mask[best]:
            return None
        adm = self.bind(job, fleet, best)
        if adm is not None:
            return [adm]
        idx = np.flatnonzero(mask)
        for k in np.argsort(-scores[idx], kind="stable"):  # the quick filter let a device through the rule refuses
            if idx[k] == best:
                continue
            adm = self.bind(job, fleet, int(idx[k]))
            if adm is not None:
                return [adm]
        return None

    def assign(self, job: Job, fleet: Fleet) -> list[Admission] | None:
        """`place`, then carry it out on the fleet."""
        admissions = self.place(job, fleet)
        if admissions is not None:
            fleet.bind(admissions, job)
        return admissions

    def score_hosts(self, hosts: np.ndarray, free_counts: np.ndarray) -> np.ndarray:
        """Rank hosts for a multi-device job by how many empty devices they have. Base: the first host."""
        return -hosts.astype(np.float64)

    def _place_gang(self, job: Job, fleet: Fleet) -> list[Admission] | None:
        by_host = fleet.whole_free_by_host(job)
        if not by_host:
            return None
        hosts = np.fromiter(by_host, dtype=np.int64, count=len(by_host))
        counts = np.array([len(by_host[h]) for h in hosts])
        host = int(hosts[int(np.argmax(self.score_hosts(hosts, counts)))])
        admissions = []
        for i in by_host[host][: job.gpus]:
            adm = fleet.admit(int(i), job, whole=True)
            if adm is None:  # cannot happen: the device was empty a moment ago
                return None
            admissions.append(adm)
        return admissions

    # ---- slowdown
    def expected_slowdown(self, job: Job, fleet: Fleet, adm: Admission) -> float:
        """How much slower the job runs at `adm` than alone: turns taken inside its lane times interference from
        the device's other lanes (co-location model)."""
        if adm.exclusive:
            return 1.0
        device = fleet.devices[fleet.index_of[adm.device_id]]
        lane = None if adm.new_lane else device.lanes[adm.lane_id]  # type: ignore[index]
        others = device.demand - (lane.demand if lane is not None else 0.0)
        in_lane = 1.0
        if lane is not None:
            # jobs of one lane alternate iterations: together they need the sum of their busy time
            in_lane = max(1.0, job.util + sum(j.util for j in lane.jobs.values()))
        cross = 1.0 / self.model.speed(job.util, min(1.0, others)) if others > 0 else 1.0
        return in_lane * cross

    def max_load(self, util: float) -> float:
        """The most compute demand a busy device may already carry for a job of `util` to join it: beyond it the
        job or the device's current load (as one neighbour) is expected to slow down by more than the cap.

        Found once per utilisation on a grid of loads (cached), so filtering a fleet is a single comparison.
        """
        key = round(util, 3)
        found = self._max_load.get(key)
        if found is None:
            grid = np.linspace(0.0, 1.0, 1001)
            floor = 1.0 / self.max_slowdown
            ok = (self.model.speed_array(key, grid) >= floor) & (self.model.speed_array(grid, key) >= floor)
            bad = np.flatnonzero(~ok)
            # loads above 1 saturate the device: allowed only if even a full device passes
            found = np.inf if bad.size == 0 else (-1.0 if bad[0] == 0 else float(grid[bad[0] - 1]))
            self._max_load[key] = found
        return found

    # ---- ordering
    def priority(self, job: Job) -> tuple[float, ...]:
        """Sort key: lowest goes first. Base: arrival order."""
        return (job.arrival,)

    def pick_next(self, jobs: Iterable[Job]) -> Job | None:
        """The job of a lane that takes the next iteration."""
        return min(jobs, key=self._key, default=None)

    def queue_order(self, jobs: Iterable[Job]) -> list[Job]:
        """Waiting jobs in the order they are offered a place."""
        return sorted(jobs, key=self._key)

    def _key(self, job: Job) -> tuple:
        return (*self.priority(job), job.arrival, job.job_id)
