"""Salus lanes in memory: admission of jobs into memory slices of devices, and a fleet index to find candidates fast.

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
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

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


@dataclass
class _Arrays:
    capacity: np.ndarray
    free: np.ndarray
    join_room: np.ndarray
    demand: np.ndarray
    n_jobs: np.ndarray
    n_lanes: np.ndarray
    slack: np.ndarray  # (free + room of the roomiest joinable lane) / capacity: what stays unused on the device
    host: np.ndarray  # host code per device
    kind: np.ndarray  # kind code per device
    alive: np.ndarray


@dataclass
class Fleet:
    """Many devices' lanes plus per-device numpy columns, so a policy filters and scores a fleet in one pass.

    Devices are addressed by their position `i` in `devices` for speed; `index_of[device_id]` maps back.
    """

    devices: list[DeviceLanes] = field(default_factory=list)
    index_of: dict[int, int] = field(default_factory=dict)
    host_codes: dict[str, int] = field(default_factory=dict)
    kind_codes: dict[str, int] = field(default_factory=dict)
    _where: dict[str, list[int]] = field(default_factory=dict)  # job -> device positions
    _jobs: dict[str, Job] = field(default_factory=dict)
    _arr: _Arrays | None = None
    _kind_masks: dict[frozenset[str], np.ndarray] = field(default_factory=dict)
    _host_masks: dict[frozenset[str], np.ndarray] = field(default_factory=dict)
    _lane_ids: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    # ---- building
    def add_device(self, device_id: int, capacity: int, *, kind: str = "", host: str = "") -> DeviceLanes:
        if device_id in self.index_of:
            raise ValueError(f"device {device_id} is already in the fleet")
        device = DeviceLanes(device_id, capacity, kind=kind, host=host, lane_ids=self._lane_ids)
        self.index_of[device_id] = len(self.devices)
        self.devices.append(device)
        self.host_codes.setdefault(host, len(self.host_codes))
        self.kind_codes.setdefault(kind, len(self.kind_codes))
        self._arr = None  # rebuilt on next use
        self._kind_masks.clear()
        self._host_masks.clear()
        return device

    def use_lane_ids(self, start: int) -> None:
        """Number new lanes from `start` on (after loading lanes whose ids came from the store)."""
        self._lane_ids = itertools.count(start)
        for device in self.devices:
            device._ids = self._lane_ids

    @property
    def arrays(self) -> _Arrays:
        if self._arr is None:
            n = len(self.devices)
            capacity = np.array([d.capacity for d in self.devices], dtype=np.int64)
            self._arr = _Arrays(
                capacity=capacity,
                free=capacity.copy(),
                join_room=np.full(n, -1, dtype=np.int64),
                demand=np.zeros(n, dtype=np.float64),
                n_jobs=np.zeros(n, dtype=np.int64),
                n_lanes=np.zeros(n, dtype=np.int64),
                slack=(capacity > 0).astype(np.float64),
                host=np.array([self.host_codes[d.host] for d in self.devices], dtype=np.int64),
                kind=np.array([self.kind_codes[d.kind] for d in self.devices], dtype=np.int64),
                alive=np.ones(n, dtype=bool),
            )
            for i, d in enumerate(self.devices):
                if d.lanes:  # an empty device is already described by the defaults above
                    self._sync(i)
        return self._arr

    def _sync(self, i: int) -> None:
        a, d = self._arr, self.devices[i]
        if a is None:
            return
        room, demand = -1, 0.0
        for lane in d.lanes.values():
            demand += lane.demand
            if not lane.exclusive:
                r = lane.size - lane.persistent_sum - lane.max_ephemeral
                if r > room:
                    room = r
        free = d.capacity - d.reserved
        a.free[i] = free
        a.join_room[i] = room
        a.demand[i] = demand
        a.n_jobs[i] = len(d._job_lane)
        a.n_lanes[i] = len(d.lanes)
        a.slack[i] = (free + (room if room > 0 else 0)) / d.capacity if d.capacity else 0.0

    def set_alive(self, device_id: int, alive: bool) -> None:
        """A lost or drained device takes no new jobs (its current jobs stay until removed)."""
        self.arrays.alive[self.index_of[device_id]] = alive

    # ---- reading
    def __len__(self) -> int:
        return len(self.devices)

    def device(self, device_id: int) -> DeviceLanes:
        return self.devices[self.index_of[device_id]]

    def job(self, job_id: str) -> Job:
        return self._jobs[job_id]

    def jobs(self) -> list[Job]:
        return list(self._jobs.values())

    def where(self, job_id: str) -> list[tuple[int, int]]:
        """(device_id, lane_id) for each device the job is on; [] if it is not placed."""
        out = []
        for i in self._where.get(job_id, ()):
            lane = self.devices[i].lane_of(job_id)
            assert lane is not None
            out.append((self.devices[i].device_id, lane.lane_id))
        return out

    def devices_in_use(self) -> int:
        return int((self.arrays.n_jobs > 0).sum())

    def kind_mask(self, kinds: frozenset[str] | None) -> np.ndarray | None:
        if kinds is None:
            return None
        mask = self._kind_masks.get(kinds)
        if mask is None:
            codes = [self.kind_codes[k] for k in kinds if k in self.kind_codes]
            mask = np.isin(self.arrays.kind, codes)
            self._kind_masks[kinds] = mask
        return mask

    def host_mask(self, hosts: frozenset[str]) -> np.ndarray:
        """The devices on `hosts`, as a boolean mask over all device positions (many jobs share one set of hosts:
        a checkpoint location and the hosts that can read it)."""
        mask = self._host_masks.get(hosts)
        if mask is None:
            codes = [self.host_codes[h] for h in hosts if h in self.host_codes]
            mask = self._host_masks[hosts] = np.isin(self.arrays.host, codes)
        return mask

    def candidates(self, job: Job, whole: bool | None = None) -> np.ndarray:
        """Positions of devices that may admit the job (a quick necessary test; `admit` is the exact one)."""
        return np.flatnonzero(self.candidate_mask(job, whole))

    def candidate_mask(self, job: Job, whole: bool | None = None) -> np.ndarray:
        """`candidates` as a boolean mask over all device positions."""
        a = self.arrays
        p_prime = charged(job.persistent)
        need = p_prime + max(0, job.ephemeral)
        if job.whole_devices if whole is None else whole:
            mask = a.alive & (a.n_lanes == 0) & (a.capacity >= need)
        else:
            size = np.minimum(lane_size(p_prime, job.ephemeral), a.capacity)
            mask = a.alive & (a.capacity >= need) & ((a.free >= size) | (a.join_room >= p_prime))
        kinds = self.kind_mask(job.kinds)
        if kinds is not None:
            mask &= kinds
        return mask

    def whole_free_by_host(self, job: Job) -> dict[int, np.ndarray]:
        """Hosts (by code) with at least job.gpus empty devices that fit the job, each with those devices' positions."""
        idx = self.candidates(job, whole=True)
        if idx.size == 0:
            return {}
        hosts = self.arrays.host[idx]
        counts = np.bincount(hosts)
        good = np.flatnonzero(counts >= job.gpus)
        if good.size == 0:
            return {}
        order = np.argsort(hosts, kind="stable")
        idx, hosts = idx[order], hosts[order]
        starts = np.searchsorted(hosts, good)
        return {int(h): idx[s:s + counts[h]] for h, s in zip(good, starts, strict=True)}

    def admit(self, i: int, job: Job, whole: bool | None = None) -> Admission | None:
        return self.devices[i].admit(job, whole)

    # ---- changes
    def bind(self, admissions: Iterable[Admission], job: Job) -> list[Lane]:
        """Carry out a placement (one admission per device) and remember the job."""
        lanes = []
        for adm in admissions:
            i = self.index_of[adm.device_id]
            lanes.append(self.devices[i].bind(adm, job.util))
            self._where.setdefault(job.job_id, []).append(i)
            self._sync(i)
        self._jobs[job.job_id] = job
        return lanes

    def place_loaded(self, job: Job, device_id: int, lane_id: int, lane_size: int, compute_share: float = 1.0,
                     p_prime: int | None = None, exclusive: bool = False) -> Lane:
        """Put back a job as the store recorded it (its lane opened if this is the lane's first job)."""
        i = self.index_of[device_id]
        device = self.devices[i]
        if lane_id not in device.lanes:
            device.add_lane(lane_size, lane_id=lane_id, compute_share=compute_share, exclusive=exclusive)
        pp = p_prime if p_prime is not None else charged(job.persistent)
        device.add_job(lane_id, job.job_id, pp, max(0, job.ephemeral), job.util)
        self._where.setdefault(job.job_id, []).append(i)
        self._jobs[job.job_id] = job
        self._sync(i)
        return device.lanes[lane_id]

    def add_to_new_lane(self, job: Job, device_id: int) -> Lane | None:
        """Open the lane Salus would give the job on this device, if the device has the room (loading a fleet)."""
        i = self.index_of[device_id]
        device = self.devices[i]
        if job.job_id in device._job_lane:
            raise ValueError(f"job {job.job_id!r} is already on device {device_id}")
        p_prime, size = lane_request(job.persistent, job.ephemeral, device.capacity)
        e = max(0, job.ephemeral)
        if p_prime + e > size or device.capacity - device.reserved < size:
            return None
        # the checks add_lane / add_job make hold by construction here; this path loads whole fleets
        lane = Lane(next(device._ids), device_id, size)
        device.lanes[lane.lane_id] = lane
        device.reserved += size
        lane._add(LaneJob(job.job_id, p_prime, e, job.util))
        device._job_lane[job.job_id] = lane.lane_id
        self._where.setdefault(job.job_id, []).append(i)
        self._jobs[job.job_id] = job
        self._sync(i)
        return lane

    def remove(self, job_id: str) -> list[Lane]:
        """Take a job off every device it is on; returns the lanes it left."""
        positions = self._where.pop(job_id, None)
        if positions is None:
            raise KeyError(f"job {job_id!r} is not placed")
        self._jobs.pop(job_id, None)
        lanes = []
        for i in positions:
            lanes.append(self.devices[i].remove(job_id))
            self._sync(i)
        return lanes

    def check(self) -> None:
        for d in self.devices:
            d.check()
        if self._arr is not None:
            a = self._arr
            for i, d in enumerate(self.devices):
                assert a.free[i] == d.free and a.n_jobs[i] == d.n_jobs and a.join_room[i] == d.join_room
