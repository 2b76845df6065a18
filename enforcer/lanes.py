"""Salus lanes in memory: admission of jobs into memory slices of devices (a fleet of them: enforcer.lane_fleet).

A lane is a slice of one device's memory; the jobs in one lane take turns an iteration at a time, so a lane must
hold the sum of its jobs' persistent memory plus the largest per-iteration (ephemeral) peak among them. Lanes of
one device run side by side and never reserve more than the device has.

Admission, as in Salus: a job with persistent memory P and ephemeral peak E asks P' = 1.1 P and a lane of
L = min(1.05 (P' + E), capacity). A new lane is opened if the device has L unreserved; otherwise the job joins the
lane with the least room where P' + max(E, the lane's largest E) still fits; otherwise it waits.

Everything here is plain Python objects plus a few numpy arrays per fleet (one entry per device), so the
planner and the simulator can drive thousands of devices in memory without a database.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from store.headroom import charged, lane_size


def lane_request(persistent: int, ephemeral: int, capacity: int) -> tuple[int, int]:
    """(P', L): the persistent memory a job is charged and the lane size it asks for on a device of `capacity`."""
    p_prime = charged(persistent)
    # at least one byte, so that a job using no memory still takes a slot and a fully held device refuses it
    size = min(lane_size(p_prime, ephemeral), capacity)
    return p_prime, size


@dataclass(slots=True)
class Job:
    """What a job asks of the fleet, and the progress the ordering policies look at.

    persistent / ephemeral: bytes per device (P and E as the SDK measured them, before Salus's headroom).
    util: the job's solo device utilisation 0..1 (its compute demand). gpus > 1 or exclusive: whole devices only,
    all on one host. kinds: device kinds (model names) the job may run on; None = any.
    """

    job_id: str
    persistent: int = 0
    ephemeral: int = 0
    util: float = 1.0
    gpus: int = 1
    exclusive: bool = False
    kinds: frozenset[str] | None = None
    arrival: float = 0.0
    attained_s: float = 0.0  # device-seconds of service so far (FAIR)
    remaining_s: float | None = None  # expected seconds of work left (SRTF); None = unknown

    @property
    def whole_devices(self) -> bool:
        return self.exclusive or self.gpus > 1


def remaining_time(declared_steps: int | None, steps_done: int, step_s: float | None) -> float | None:
    """Seconds of work left from the declared step count and the measured seconds per step (None if unknown)."""
    if declared_steps is None or step_s is None:
        return None
    return max(0, declared_steps - steps_done) * step_s


@dataclass(slots=True)
class LaneJob:
    job_id: str
    p_prime: int
    ephemeral: int
    util: float


@dataclass(frozen=True, slots=True)
class Admission:
    """Where a job would go: an existing lane (lane_id) or a new lane of lane_size (lane_id None)."""

    job_id: str
    device_id: int
    lane_id: int | None
    lane_size: int
    p_prime: int
    ephemeral: int
    exclusive: bool = False

    @property
    def new_lane(self) -> bool:
        return self.lane_id is None


def lane_fits(size: int, persistent_sum: int, max_ephemeral: int, p_prime: int, ephemeral: int) -> bool:
    """Salus's rule for joining a lane of `size` whose jobs hold `persistent_sum` and peak at `max_ephemeral`: the
    persistent memory of all, the newcomer's P' included, plus the largest ephemeral peak among them must fit."""
    return size - persistent_sum >= p_prime + max(ephemeral, max_ephemeral)


def whole_device_fits(capacity: int, p_prime: int, ephemeral: int) -> bool:
    """Whether a job of P' and E fits on an empty device of `capacity` on its own."""
    return p_prime + ephemeral <= capacity


class Lane:
    """One memory slice of a device and the jobs that take turns in it."""

    __slots__ = ("lane_id", "device_id", "size", "compute_share", "exclusive", "jobs", "persistent_sum",
                 "max_ephemeral", "demand")

    def __init__(self, lane_id: int, device_id: int, size: int, compute_share: float = 1.0,
                 exclusive: bool = False) -> None:
        self.lane_id = lane_id
        self.device_id = device_id
        self.size = size
        self.compute_share = compute_share
        self.exclusive = exclusive  # a whole device held by one job: nobody joins
        self.jobs: dict[str, LaneJob] = {}
        self.persistent_sum = 0
        self.max_ephemeral = 0
        # compute demand of the lane: its jobs alternate, so the busiest one's utilisation, not the sum
        self.demand = 0.0

    @property
    def used(self) -> int:
        return self.persistent_sum + self.max_ephemeral

    @property
    def room(self) -> int:
        return self.size - self.used

    def fits(self, p_prime: int, ephemeral: int) -> bool:
        return (not self.exclusive) and lane_fits(self.size, self.persistent_sum, self.max_ephemeral, p_prime,
                                                  ephemeral)

    def _add(self, job: LaneJob) -> None:
        self.jobs[job.job_id] = job
        self.persistent_sum += job.p_prime
        if job.ephemeral > self.max_ephemeral:
            self.max_ephemeral = job.ephemeral
        if job.util > self.demand:
            self.demand = job.util

    def _remove(self, job_id: str) -> LaneJob:
        job = self.jobs.pop(job_id)
        self.persistent_sum -= job.p_prime
        if job.ephemeral >= self.max_ephemeral:
            self.max_ephemeral = max((j.ephemeral for j in self.jobs.values()), default=0)
        if job.util >= self.demand:
            self.demand = max((j.util for j in self.jobs.values()), default=0.0)
        return job

    def __repr__(self) -> str:
        return (f"Lane({self.lane_id}, device={self.device_id}, size={self.size}, used={self.used}, "
                f"jobs={list(self.jobs)})")


class DeviceLanes:
    """The lanes of one device and Salus's admission rule on them."""

    __slots__ = ("device_id", "capacity", "kind", "host", "lanes", "reserved", "_ids", "_job_lane")

    def __init__(self, device_id: int, capacity: int, *, kind: str = "", host: str = "",
                 lane_ids: Iterator[int] | None = None) -> None:
        if capacity < 0:
            raise ValueError(f"device {device_id}: capacity {capacity} is negative")
        self.device_id = device_id
        self.capacity = int(capacity)
        self.kind = kind
        self.host = host
        self.lanes: dict[int, Lane] = {}
        self.reserved = 0  # sum of lane sizes
        self._ids = lane_ids if lane_ids is not None else itertools.count(1)
        self._job_lane: dict[str, int] = {}

    # ---- reading
    @property
    def free(self) -> int:
        """Memory not reserved by any lane."""
        return self.capacity - self.reserved

    @property
    def n_jobs(self) -> int:
        return len(self._job_lane)

    @property
    def demand(self) -> float:
        return sum(lane.demand for lane in self.lanes.values())

    @property
    def join_room(self) -> int:
        """The most room of any lane a job may join (-1 when none): a job needs at least its P' of it."""
        return max((lane.room for lane in self.lanes.values() if not lane.exclusive), default=-1)

    def lane_of(self, job_id: str) -> Lane | None:
        lane_id = self._job_lane.get(job_id)
        return None if lane_id is None else self.lanes[lane_id]

    def jobs(self) -> list[str]:
        return list(self._job_lane)

    def compute_shares(self) -> dict[int, float]:
        """Each lane's share of the device's compute: its demand, scaled down when the lanes ask for more than all."""
        demands = {lane_id: max(lane.demand, 1e-3) for lane_id, lane in self.lanes.items()}
        total = sum(demands.values())
        scale = 1.0 / total if total > 1.0 else 1.0
        return {lane_id: min(1.0, d * scale) for lane_id, d in demands.items()}

    # ---- admission (no change to the device)
    def admit(self, job: Job, whole: bool | None = None) -> Admission | None:
        """Salus's rule for one device: a new lane if there is room, else the fitting lane with least room.

        `whole` (default: the job's own wish) asks for the whole, empty device instead of a lane.
        """
        if job.whole_devices if whole is None else whole:
            return self.admit_whole(job)
        p_prime, size = lane_request(job.persistent, job.ephemeral, self.capacity)
        e = max(0, job.ephemeral)
        if p_prime + e > size:  # bigger than the whole device: it can never run here
            return None
        if self.free >= size:
            return Admission(job.job_id, self.device_id, None, size, p_prime, e)
        best: Lane | None = None
        for lane in self.lanes.values():
            if lane.fits(p_prime, e) and (best is None or lane.room < best.room):
                best = lane
        if best is None:
            return None
        return Admission(job.job_id, self.device_id, best.lane_id, best.size, p_prime, e)

    def admit_whole(self, job: Job) -> Admission | None:
        """A whole device for one job (exclusive or part of a multi-device job): only an empty device will do."""
        p_prime, _ = lane_request(job.persistent, job.ephemeral, self.capacity)
        e = max(0, job.ephemeral)
        if self.lanes or not whole_device_fits(self.capacity, p_prime, e):
            return None
        return Admission(job.job_id, self.device_id, None, self.capacity, p_prime, e, exclusive=True)

    # ---- changes
    def bind(self, admission: Admission, util: float = 1.0, lane_id: int | None = None) -> Lane:
        """Carry out an admission; `lane_id` names a new lane (e.g. the store's id), else one is numbered here."""
        if admission.device_id != self.device_id:
            raise ValueError(f"admission for device {admission.device_id} bound on device {self.device_id}")
        if admission.job_id in self._job_lane:
            raise ValueError(f"job {admission.job_id!r} is already on device {self.device_id}")
        if admission.new_lane:
            lane = self.add_lane(admission.lane_size, lane_id=lane_id, exclusive=admission.exclusive)
        else:
            lane = self.lanes.get(admission.lane_id)  # type: ignore[arg-type]
            if lane is None:
                raise ValueError(f"device {self.device_id} has no lane {admission.lane_id}")
        self.add_job(lane.lane_id, admission.job_id, admission.p_prime, admission.ephemeral, util)
        return lane

    def add_lane(self, size: int, *, lane_id: int | None = None, compute_share: float = 1.0,
                 exclusive: bool = False) -> Lane:
        """Open a lane (loading from the store, or from an admission); refuses what the device cannot hold."""
        if size < 0 or size > self.free:
            raise ValueError(f"device {self.device_id}: a lane of {size} bytes does not fit in {self.free} free")
        if exclusive and self.lanes:
            raise ValueError(f"device {self.device_id}: a whole-device lane needs an empty device")
        lane_id = next(self._ids) if lane_id is None else lane_id
        if lane_id in self.lanes:
            raise ValueError(f"device {self.device_id} already has lane {lane_id}")
        lane = Lane(lane_id, self.device_id, size, compute_share, exclusive)
        self.lanes[lane_id] = lane
        self.reserved += size
        return lane

    def add_job(self, lane_id: int, job_id: str, p_prime: int, ephemeral: int, util: float = 1.0) -> LaneJob:
        lane = self.lanes[lane_id]
        if job_id in self._job_lane:
            raise ValueError(f"job {job_id!r} is already on device {self.device_id}")
        if lane.exclusive and lane.jobs:
            raise ValueError(f"lane {lane_id} holds a whole device for {next(iter(lane.jobs))!r}")
        if not lane_fits(lane.size, lane.persistent_sum, lane.max_ephemeral, p_prime, ephemeral):
            raise ValueError(f"job {job_id!r} ({p_prime} + {ephemeral} bytes) does not fit in lane {lane_id}")
        job = LaneJob(job_id, p_prime, ephemeral, util)
        lane._add(job)
        self._job_lane[job_id] = lane_id
        return job

    def remove(self, job_id: str) -> Lane:
        """Take a job off the device; a lane left empty closes and gives its memory back."""
        lane_id = self._job_lane.pop(job_id, None)
        if lane_id is None:
            raise KeyError(f"job {job_id!r} is not on device {self.device_id}")
        lane = self.lanes[lane_id]
        lane._remove(job_id)
        if not lane.jobs:
            del self.lanes[lane_id]
            self.reserved -= lane.size
        return lane

    def check(self) -> None:
        """Raise AssertionError if an invariant is broken (tests and simulator self-checks)."""
        assert 0 <= self.reserved <= self.capacity, (self.device_id, self.reserved, self.capacity)
        assert self.reserved == sum(lane.size for lane in self.lanes.values())
        for lane in self.lanes.values():
            assert lane.jobs, f"empty lane {lane.lane_id} left open"
            assert lane.used <= lane.size, lane
            assert lane.persistent_sum == sum(j.p_prime for j in lane.jobs.values())
            assert lane.max_ephemeral == max(j.ephemeral for j in lane.jobs.values())
            assert lane.demand == max(j.util for j in lane.jobs.values())
            assert not (lane.exclusive and len(lane.jobs) > 1)
