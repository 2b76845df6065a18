"""Salus lanes in memory: admission of jobs into memory slices of devices (a fleet of them: enforcer.lane_fleet).

A lane is a slice of one device's memory; the jobs in one lane take turns an iteration at a time, so a lane must
hold the sum of its jobs' persistent memory plus the largest per-iteration (ephemeral) peak among them. Lanes of
one device run side by side and never reserve more than the device has.

Admission, as in Salus: a job with persistent memory P and ephemeral peak E asks P' = 1.1 P and a lane of
L = min(1.05 (P' + E), capacity - C). A new lane is opened if the device has L + C unreserved; otherwise the job
joins the lane with the least room where P' + max(E, the lane's largest E) still fits and the device still has C;
otherwise it waits.

C is the job's memory outside PyTorch's caching allocator: its CUDA context (a few hundred MiB per process) and
the cuDNN / cuBLAS / NCCL workspaces. It is counted against the device beside the lanes, not inside them, because
that is where it lives: a lane is the caching allocator's slice (what the launcher's per-process memory fraction
caps, and only that), and C is held by each process for its whole life, whether it is its turn or not, so
turn-taking shares none of it. A lane of n jobs therefore takes its size plus the sum of its n jobs' C from the
device, and the sizes of all lanes plus all contexts never exceed the device (`DeviceLanes.check`). Charging C to
the lane instead would be the same sum, but would let the launcher's caps (fractions of the lane) hand a job memory
its context already took. A job holding a device whole has its C inside its whole-device lane. C is the measured
figure when the store has one (`Job.context`), else the device's default charge (`context_default`, from
settings). Jobs whose memory already is what NVML sees of the process (trace replays, consolidation's telemetry
sizing) carry context 0: their figure already includes it.

Everything here is plain Python objects plus a few numpy arrays per fleet (one entry per device), so the
planner and the simulator can drive thousands of devices in memory without a database.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from store.headroom import charged, lane_size


def lane_request(persistent: int, ephemeral: int, capacity: int, context: int = 0) -> tuple[int, int]:
    """(P', L): the persistent memory a job is charged and the lane size it asks for on a device of `capacity`,
    whose `context` bytes (C) sit beside the lane."""
    p_prime = charged(persistent)
    # at least one byte, so that a job using no memory still takes a slot and a fully held device refuses it
    size = min(lane_size(p_prime, ephemeral), max(0, capacity - context))
    return p_prime, size


def check_context(context: int | None, what: str) -> None:
    """Refuse a context charge that is not a whole number of bytes >= 0 (None: unknown, the default applies)."""
    if context is not None and (isinstance(context, bool) or not isinstance(context, int) or context < 0):
        raise ValueError(f"{what}: context memory {context!r} must be a whole number of bytes >= 0 (or None: "
                         "unknown, charged the default)")


@dataclass(slots=True)
class Job:
    """What a job asks of the fleet, and the progress the ordering policies look at.

    persistent / ephemeral: bytes per device (P and E as the SDK measured them, before Salus's headroom).
    util: the job's solo device utilisation 0..1 (its compute demand). gpus > 1 or exclusive: whole devices only,
    all on one host. kinds: device kinds (model names) the job may run on; None = any. context: C, bytes per process
    outside the caching allocator (CUDA context, library workspaces) as measured; None = not measured, the device's
    default charge applies; 0 = already inside `persistent` (figures read from NVML).
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
    context: int | None = None

    def __post_init__(self) -> None:
        check_context(self.context, f"job {self.job_id!r}")

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
    context: int = 0  # C, held beside the lane (0 in a whole-device lane, whose size already holds it)


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
    context: int = 0  # C charged beside the lane (0 for a whole device: its lane holds it)

    @property
    def new_lane(self) -> bool:
        return self.lane_id is None


def lane_fits(size: int, persistent_sum: int, max_ephemeral: int, p_prime: int, ephemeral: int) -> bool:
    """Salus's rule for joining a lane of `size` whose jobs hold `persistent_sum` and peak at `max_ephemeral`: the
    persistent memory of all, the newcomer's P' included, plus the largest ephemeral peak among them must fit."""
    return size - persistent_sum >= p_prime + max(ephemeral, max_ephemeral)


def whole_device_fits(capacity: int, p_prime: int, ephemeral: int, context: int = 0) -> bool:
    """Whether a job of P', E and out-of-allocator memory C fits on an empty device of `capacity` on its own."""
    return p_prime + ephemeral + context <= capacity


class Lane:
    """One memory slice of a device and the jobs that take turns in it."""

    __slots__ = ("lane_id", "device_id", "size", "compute_share", "exclusive", "joinable", "jobs", "persistent_sum",
                 "max_ephemeral", "demand")

    def __init__(self, lane_id: int, device_id: int, size: int, compute_share: float = 1.0,
                 exclusive: bool = False, joinable: bool = True) -> None:
        self.lane_id = lane_id
        self.device_id = device_id
        self.size = size
        self.compute_share = compute_share
        self.exclusive = exclusive  # a whole device held by one job: nobody joins
        # False: nobody joins either, though it is sized as a lane: its job takes no turns with newcomers (a job that
        # holds its device whole, which the planner counts as the lane Salus would give it, so others fit beside it)
        self.joinable = joinable and not exclusive
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
        return self.joinable and lane_fits(self.size, self.persistent_sum, self.max_ephemeral, p_prime, ephemeral)

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

    __slots__ = ("device_id", "capacity", "kind", "host", "lanes", "reserved", "contexts", "context_default", "_ids",
                 "_job_lane")

    def __init__(self, device_id: int, capacity: int, *, kind: str = "", host: str = "",
                 lane_ids: Iterator[int] | None = None, context_default: int = 0) -> None:
        """`context_default`: C charged to a job whose own is not measured (Job.context None); entry points pass
        the settings' figure (Settings.context_bytes). 0 only where every job's memory already includes it."""
        if capacity < 0:
            raise ValueError(f"device {device_id}: capacity {capacity} is negative")
        check_context(context_default, f"device {device_id}")
        self.device_id = device_id
        self.capacity = int(capacity)
        self.kind = kind
        self.host = host
        self.lanes: dict[int, Lane] = {}
        self.reserved = 0  # sum of lane sizes
        self.contexts = 0  # sum of the C of jobs in shared lanes: beside the lanes, per process
        self.context_default = context_default
        self._ids = lane_ids if lane_ids is not None else itertools.count(1)
        self._job_lane: dict[str, int] = {}

    # ---- reading
    @property
    def free(self) -> int:
        """Memory neither reserved by a lane nor held by a lane job's context."""
        return self.capacity - self.reserved - self.contexts

    def context_of(self, job: Job) -> int:
        """C charged for the job here: its measured figure, else this device's default."""
        return self.context_default if job.context is None else job.context

    @property
    def n_jobs(self) -> int:
        return len(self._job_lane)

    @property
    def demand(self) -> float:
        return sum(lane.demand for lane in self.lanes.values())

    @property
    def join_room(self) -> int:
        """The most room of any lane a job may join (-1 when none): a job needs at least its P' of it."""
        return max((lane.room for lane in self.lanes.values() if lane.joinable), default=-1)

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
        c = self.context_of(job)
        p_prime, size = lane_request(job.persistent, job.ephemeral, self.capacity, c)
        e = max(0, job.ephemeral)
        if p_prime + e > size:  # bigger than the whole device (less its context): it can never run here
            return None
        if self.free >= size + c:
            return Admission(job.job_id, self.device_id, None, size, p_prime, e, context=c)
        if self.free < c:  # no lane can take it: its context needs room beside every lane
            return None
        best: Lane | None = None
        for lane in self.lanes.values():
            if lane.fits(p_prime, e) and (best is None or lane.room < best.room):
                best = lane
        if best is None:
            return None
        return Admission(job.job_id, self.device_id, best.lane_id, best.size, p_prime, e, context=c)

    def admit_whole(self, job: Job) -> Admission | None:
        """A whole device for one job (exclusive or part of a multi-device job): only an empty device will do."""
        p_prime, _ = lane_request(job.persistent, job.ephemeral, self.capacity)
        e = max(0, job.ephemeral)
        # its context lives inside the whole-device lane, so the admission charges none beside it
        if self.lanes or not whole_device_fits(self.capacity, p_prime, e, self.context_of(job)):
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
        self.add_job(lane.lane_id, admission.job_id, admission.p_prime, admission.ephemeral, util,
                     context=admission.context)
        return lane

    def add_lane(self, size: int, *, lane_id: int | None = None, compute_share: float = 1.0,
                 exclusive: bool = False, joinable: bool = True) -> Lane:
        """Open a lane (loading from the store, or from an admission); refuses what the device cannot hold.
        `joinable` False: a lane for one job that nobody joins (Lane.joinable)."""
        if size < 0 or size > self.free:
            raise ValueError(f"device {self.device_id}: a lane of {size} bytes does not fit in {self.free} free")
        if exclusive and self.lanes:
            raise ValueError(f"device {self.device_id}: a whole-device lane needs an empty device")
        lane_id = next(self._ids) if lane_id is None else lane_id
        if lane_id in self.lanes:
            raise ValueError(f"device {self.device_id} already has lane {lane_id}")
        lane = Lane(lane_id, self.device_id, size, compute_share, exclusive, joinable)
        self.lanes[lane_id] = lane
        self.reserved += size
        return lane

    def add_job(self, lane_id: int, job_id: str, p_prime: int, ephemeral: int, util: float = 1.0, *,
                context: int = 0) -> LaneJob:
        """Put a job into a lane; its `context` (C) is taken from the device beside the lanes (none in a
        whole-device lane, which already holds it). Refuses what the lane or the device cannot hold."""
        lane = self.lanes[lane_id]
        check_context(context, f"job {job_id!r}")
        if job_id in self._job_lane:
            raise ValueError(f"job {job_id!r} is already on device {self.device_id}")
        if lane.exclusive and lane.jobs:
            raise ValueError(f"lane {lane_id} holds a whole device for {next(iter(lane.jobs))!r}")
        if not lane.joinable and lane.jobs:
            raise ValueError(f"lane {lane_id} is {next(iter(lane.jobs))!r}'s alone: nobody joins it")
        if not lane_fits(lane.size, lane.persistent_sum, lane.max_ephemeral, p_prime, ephemeral):
            raise ValueError(f"job {job_id!r} ({p_prime} + {ephemeral} bytes) does not fit in lane {lane_id}")
        c = 0 if lane.exclusive else context
        if c > self.free:
            raise ValueError(f"job {job_id!r}'s context ({c} bytes, outside every lane) does not fit beside the "
                             f"lanes of device {self.device_id} ({self.free} free)")
        job = LaneJob(job_id, p_prime, ephemeral, util, c)
        lane._add(job)
        self.contexts += c
        self._job_lane[job_id] = lane_id
        return job

    def remove(self, job_id: str) -> Lane:
        """Take a job off the device; a lane left empty closes and gives its memory back."""
        lane_id = self._job_lane.pop(job_id, None)
        if lane_id is None:
            raise KeyError(f"job {job_id!r} is not on device {self.device_id}")
        lane = self.lanes[lane_id]
        self.contexts -= lane._remove(job_id).context
        if not lane.jobs:
            del self.lanes[lane_id]
            self.reserved -= lane.size
        return lane

    def check(self) -> None:
        """Raise AssertionError if an invariant is broken (tests and simulator self-checks)."""
        assert 0 <= self.reserved <= self.capacity, (self.device_id, self.reserved, self.capacity)
        assert self.reserved == sum(lane.size for lane in self.lanes.values())
        # the lanes (what the launcher's caps add up to) plus every process's context fit the device
        assert self.contexts == sum(j.context for lane in self.lanes.values() for j in lane.jobs.values())
        assert 0 <= self.contexts and self.reserved + self.contexts <= self.capacity, \
            (self.device_id, self.reserved, self.contexts, self.capacity)
        for lane in self.lanes.values():
            assert lane.jobs, f"empty lane {lane.lane_id} left open"
            assert lane.used <= lane.size, lane
            assert lane.persistent_sum == sum(j.p_prime for j in lane.jobs.values())
            assert lane.max_ephemeral == max(j.ephemeral for j in lane.jobs.values())
            assert lane.demand == max(j.util for j in lane.jobs.values())
            assert not (not lane.joinable and len(lane.jobs) > 1)
            assert not (lane.exclusive and any(j.context for j in lane.jobs.values()))
