"""A fleet of devices' Salus lanes (enforcer.lanes) with a numpy index per device, to find a job's candidates fast."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from enforcer.lanes import Admission, DeviceLanes, Job, Lane, LaneJob, lane_request
from store.headroom import charged, lane_size


@dataclass
class FleetArrays:
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
    context_default: np.ndarray  # C charged per device to a job whose own is not measured


@dataclass
class Fleet:
    """Many devices' lanes plus per-device numpy columns, so a policy filters and scores a fleet in one pass.

    Devices are addressed by their position `i` in `devices` for speed; `index_of[device_id]` maps back.
    `context_default` is the C (enforcer.lanes) each device charges a job whose own is not measured: entry points
    pass Settings.context_bytes; 0 suits only fleets whose jobs' memory already includes it (trace replays).
    """

    devices: list[DeviceLanes] = field(default_factory=list)
    index_of: dict[int, int] = field(default_factory=dict)
    host_codes: dict[str, int] = field(default_factory=dict)
    kind_codes: dict[str, int] = field(default_factory=dict)
    _where: dict[str, list[int]] = field(default_factory=dict)  # job -> device positions
    _jobs: dict[str, Job] = field(default_factory=dict)
    _arr: FleetArrays | None = None
    _kind_masks: dict[frozenset[str], np.ndarray] = field(default_factory=dict)
    _host_masks: dict[frozenset[str], np.ndarray] = field(default_factory=dict)
    _lane_ids: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    context_default: int = 0

    # ---- building
    def add_device(self, device_id: int, capacity: int, *, kind: str = "", host: str = "",
                   context_default: int | None = None) -> DeviceLanes:
        """Add a device; `context_default` (default: the fleet's) is the C it charges a job not measured."""
        if device_id in self.index_of:
            raise ValueError(f"device {device_id} is already in the fleet")
        device = DeviceLanes(device_id, capacity, kind=kind, host=host, lane_ids=self._lane_ids,
                             context_default=self.context_default if context_default is None else context_default)
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
    def arrays(self) -> FleetArrays:
        if self._arr is None:
            n = len(self.devices)
            capacity = np.array([d.capacity for d in self.devices], dtype=np.int64)
            self._arr = FleetArrays(
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
                context_default=np.array([d.context_default for d in self.devices], dtype=np.int64),
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
            if lane.joinable:
                r = lane.size - lane.persistent_sum - lane.max_ephemeral
                if r > room:
                    room = r
        free = d.capacity - d.reserved - d.contexts
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
        c = a.context_default if job.context is None else job.context
        need = p_prime + max(0, job.ephemeral) + c
        if job.whole_devices if whole is None else whole:
            mask = a.alive & (a.n_lanes == 0) & (a.capacity >= need)
        else:
            size = np.minimum(lane_size(p_prime, job.ephemeral), a.capacity - c)
            mask = a.alive & (a.capacity >= need) & ((a.free >= size + c) | ((a.join_room >= p_prime) & (a.free >= c)))
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
                     p_prime: int | None = None, exclusive: bool = False, joinable: bool = True) -> Lane:
        """Put back a job as the store recorded it (its lane opened if this is the lane's first job; `joinable`
        False: one nobody joins), its context charged beside the lane (none in a whole-device lane); ValueError when
        the device cannot hold it."""
        i = self.index_of[device_id]
        device = self.devices[i]
        if lane_id not in device.lanes:
            device.add_lane(lane_size, lane_id=lane_id, compute_share=compute_share, exclusive=exclusive,
                            joinable=joinable)
        pp = p_prime if p_prime is not None else charged(job.persistent)
        device.add_job(lane_id, job.job_id, pp, max(0, job.ephemeral), job.util, context=device.context_of(job))
        self._where.setdefault(job.job_id, []).append(i)
        self._jobs[job.job_id] = job
        self._sync(i)
        return device.lanes[lane_id]

    def add_to_new_lane(self, job: Job, device_id: int, *, joinable: bool = True) -> Lane | None:
        """Open the lane Salus would give the job on this device, if the device has the room (loading a fleet);
        `joinable` False: nobody joins it (Lane.joinable)."""
        i = self.index_of[device_id]
        device = self.devices[i]
        if job.job_id in device._job_lane:
            raise ValueError(f"job {job.job_id!r} is already on device {device_id}")
        c = device.context_of(job)
        p_prime, size = lane_request(job.persistent, job.ephemeral, device.capacity, c)
        e = max(0, job.ephemeral)
        if p_prime + e > size or device.free < size + c:
            return None
        # the checks add_lane / add_job make hold by construction here; this path loads whole fleets
        lane = Lane(next(device._ids), device_id, size, joinable=joinable)
        device.lanes[lane.lane_id] = lane
        device.reserved += size
        device.contexts += c
        lane._add(LaneJob(job.job_id, p_prime, e, job.util, c))
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
