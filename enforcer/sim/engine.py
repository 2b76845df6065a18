"""The discrete-event core: replays jobs on a fleet of devices (enforcer.lanes), with lanes, time slicing and
co-location slowdown, and records what the metrics and the invariant checks need.

Progress model. A job has `work` seconds to do alone. On a device, the active job of each lane runs; lanes
run side by side, each active job at the speed enforcer.interference gives it next to the other lanes' active
jobs (jobs sized by a compute quota -- openb's gpu_milli -- whose quotas add up to at most one device run at
full speed: that is what the quota buys). Inside a lane, jobs take turns an iteration at a time, so who is
active is the policy's lane discipline (enforcer.discipline, the live gate's rule):
  job order        the earliest arrival runs until done (FIFO),
  round robin      lane-mates alternate, so each has an equal share of the lane's turns (PACK),
  least remaining  the least remaining work runs, preempting at the next iteration (SRTF; the trace gives each
                   job's work, where the live gate measures a newcomer with one step first),
  least attained   the jobs with the least device time share the lane equally (FAIR).
A job preempted off its devices (Tiresias) pays `migration_cost_s` of extra work when it starts again.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from enforcer.discipline import LEAST_ATTAINED, Turn, shares
from enforcer.interference import InterferenceModel
from enforcer.lane_fleet import Fleet
from enforcer.lanes import Admission, Job
from enforcer.sim.convert import to_lane_job
from enforcer.sim.metrics import summarize
from enforcer.sim.model import NodeSpec, SimJob
from store.errors import InvalidInput
from store.headroom import PERSISTENT_FACTOR

EPS = 1e-9
ARRIVE, DONE, WAKE = 0, 1, 2


class SimPolicy(Protocol):
    """What the engine asks of a policy (enforcer/sim/adapter.py wraps the enforcer's policies in this)."""

    name: str
    lane_discipline: str  # enforcer.discipline's kinds: job_order | round_robin | least_attained | least_remaining
    exclusive: bool  # every job gets whole devices, nobody shares

    def queue_order(self, waiting: list[JobState]) -> list[JobState]: ...

    def place(self, fleet: Fleet, job: Job) -> list[Admission] | None: ...


class Scheduler(Protocol):
    """A policy that decides the whole running set itself (Tiresias): called instead of the queue pass."""

    name: str
    lane_discipline: str
    exclusive: bool
    preemptive: bool

    def schedule(self, sim: Simulation, t: float) -> set[int]: ...


@dataclass(slots=True, eq=False)
class JobState:
    sim: SimJob
    job: Job  # what enforcer.lanes / the policies see
    idx: int
    remaining: float  # seconds of work left (at full speed), including any restart overhead
    state: int = 0  # 0 waiting, 1 running, 2 done
    attained: float = 0.0  # wall seconds active on its devices (x gpus): FAIR's and Tiresias's service
    start: float | None = None
    finish: float | None = None
    positions: list[int] = field(default_factory=list)
    speed: float = 0.0  # work seconds done per second, now
    active: float = 0.0  # share of the lane's turns it has now (0 when waiting its turn)
    last_t: float = 0.0
    version: int = 0
    served: float = 0.0  # work done so far (the conservation check)
    overhead: float = 0.0  # restart costs added to its work
    preemptions: int = 0
    intervals: list[tuple[int, float, float]] = field(default_factory=list)  # (device position, on, off)
    _on: float = 0.0


@dataclass
class DeviceTrack:
    """Per-device running integrals, updated whenever the device changes."""

    last_t: float = 0.0
    busy: bool = False
    util: float = 0.0
    frag: float = 0.0


class Simulation:
    """One run of one policy over one list of jobs on one cluster. `run()` returns the SimResult."""

    def __init__(
        self,
        jobs: list[SimJob],
        cluster: list[NodeSpec],
        policy: SimPolicy | Scheduler,
        *,
        interference: InterferenceModel | None = None,
        migration_cost_s: float = 30.0,
        check: bool = False,
    ) -> None:
        self.policy = policy
        self.interference = interference or InterferenceModel()
        self.migration_cost_s = migration_cost_s
        self.check = check
        self.fleet = Fleet()
        self.node_of: list[int] = []
        dev_id = itertools.count()
        for n_i, node in enumerate(cluster):
            for _ in range(node.devices):
                self.fleet.add_device(next(dev_id), node.mem, kind=node.model, host=node.name)
                self.node_of.append(n_i)
        self.capacity = np.array([d.capacity for d in self.fleet.devices], dtype=np.int64)
        quota_mem = int(self.capacity.max()) if len(self.capacity) else 1
        self.jobs = [
            JobState(j, to_lane_job(j, exclusive=policy.exclusive, quota_device_mem=quota_mem), i, j.work)
            for i, j in enumerate(sorted(jobs, key=lambda j: (j.arrival, j.id)))
        ]
        self.by_id = {js.job.job_id: js for js in self.jobs}
        if len(self.by_id) != len(self.jobs):
            # the fleet and this index know a job by its id: a second job of one id would take the first's place
            twice = sorted(k for k, n in Counter(js.job.job_id for js in self.jobs).items() if n > 1)
            raise InvalidInput(f"job ids {', '.join(map(repr, twice[:5]))} appear more than once in the trace; "
                               "give each job an id of its own")
        self.waiting: dict[int, JobState] = {}
        self.running: dict[int, JobState] = {}
        self.tracks = [DeviceTrack() for _ in self.fleet.devices]
        self.events: list[tuple[float, int, int, int, int]] = []
        self._seq = itertools.count()
        self.now = 0.0
        self.n_busy = 0
        self.busy_series: list[tuple[float, int]] = [(0.0, 0)]
        self.queue_series: list[tuple[float, int]] = [(0.0, 0)]
        self.integrals = {"busy": 0.0, "util": 0.0, "frag": 0.0}
        self.n_events = 0
        self.unplaceable: list[str] = []
        self.unplaceable_reasons: dict[str, str] = {}  # job -> why no device could ever hold it

    # ---- events
    def push(self, t: float, kind: int, idx: int = -1, version: int = 0) -> None:
        heapq.heappush(self.events, (t, next(self._seq), kind, idx, version))

    def run(self):
        if self.jobs:
            self.now = self.jobs[0].sim.arrival
            self.busy_series = [(self.now, 0)]
            self.queue_series = [(self.now, 0)]
            for t in self.tracks:
                t.last_t = self.now
        for js in self.jobs:
            why = self._why_unplaceable(js)
            if why:
                self.unplaceable.append(js.job.job_id)
                self.unplaceable_reasons[js.job.job_id] = why
                js.state = 2
                continue
            self.push(js.sim.arrival, ARRIVE, js.idx)
        while self.events:
            t = self.events[0][0]
            self.now = t
            touched: set[int] = set()
            while self.events and self.events[0][0] <= t + EPS:
                _, _, kind, idx, version = heapq.heappop(self.events)
                self.n_events += 1
                if kind == ARRIVE:
                    self.waiting[idx] = self.jobs[idx]
                elif kind == DONE:
                    js = self.jobs[idx]
                    if js.state == 1 and js.version == version:
                        touched.update(self._finish(js, t))
                else:  # WAKE: a lane's turn order may change (LAS catch-up, Tiresias demotion)
                    if idx >= 0:
                        touched.add(idx)
            touched = self._reschedule(t, touched)
            self.queue_series.append((t, len(self.waiting)))
            if self.check:
                self.check_state(touched)
        self._flush(self.now)
        if self.check:
            self.fleet.check()
        return summarize(self)

    def _why_unplaceable(self, js: JobState) -> str:
        """Why no device (or node, for a multi-device job) could ever hold the job ('' if one can): reported per
        job, not waited on forever."""
        if not len(self.capacity):
            return "the cluster has no devices"
        need = math.ceil(PERSISTENT_FACTOR * js.job.persistent) + js.job.ephemeral
        biggest = int(self.capacity.max())
        if need > biggest:
            return (f"needs {need / 2**30:.1f} GiB with Salus's headroom (memory {(js.sim.mem or need) / 2**30:.1f}"
                    f" GiB); the largest device has {biggest / 2**30:.1f} GiB")
        if js.job.gpus > 1:
            # devices that each hold it, per node: a node of many small devices does not count
            holding = np.asarray(self.node_of)[self.capacity >= need]
            most = int(np.bincount(holding).max()) if holding.size else 0
            if js.job.gpus > most:
                return (f"needs {js.job.gpus} devices of {need / 2**30:.1f} GiB on one node; the most any node has is "
                        f"{most}")
        return ""

    def _reschedule(self, t: float, touched: set[int]) -> set[int]:
        if getattr(self.policy, "preemptive", False):
            touched.update(self.policy.schedule(self, t))  # type: ignore[union-attr]
        else:
            touched.update(self._queue_pass(t))
        for pos in touched:
            self.update_device(pos, t)
        return touched

    def _queue_pass(self, t: float) -> set[int]:
        touched: set[int] = set()
        if not self.waiting:
            return touched
        failed: set[tuple] = set()
        for js in self.policy.queue_order(list(self.waiting.values())):  # type: ignore[union-attr]
            key = (js.job.gpus, js.job.persistent, js.job.ephemeral, js.job.util, js.job.exclusive)
            if key in failed:
                continue
            admissions = self.policy.place(self.fleet, js.job)  # type: ignore[union-attr]
            if not admissions:
                failed.add(key)
                continue
            touched.update(self.start(js, admissions, t))
        return touched

    # ---- job moves (the schedulers call these)
    def start(self, js: JobState, admissions: list[Admission], t: float) -> list[int]:
        self.fleet.bind(admissions, js.job)
        self.waiting.pop(js.idx, None)
        self.running[js.idx] = js
        js.state = 1
        if js.start is None:
            js.start = t
        elif js.preemptions:
            js.remaining += self.migration_cost_s
            js.overhead += self.migration_cost_s
        js.positions = [self.fleet.index_of[a.device_id] for a in admissions]
        js.speed = js.active = 0.0
        js.last_t = js._on = t
        return js.positions

    def preempt(self, js: JobState, t: float) -> list[int]:
        """Take a running job off its devices (it checkpoints; it pays the migration cost when it restarts)."""
        positions = list(js.positions)
        for pos in positions:
            self.update_device(pos, t, sync_only=True)
        self._advance(js, t)
        for pos in positions:
            js.intervals.append((pos, js._on, t))
        self.fleet.remove(js.job.job_id)
        del self.running[js.idx]
        self.waiting[js.idx] = js
        js.state = 0
        js.positions = []
        js.speed = js.active = 0.0
        js.version += 1
        js.preemptions += 1
        return positions

    def _finish(self, js: JobState, t: float) -> list[int]:
        positions = list(js.positions)
        for pos in positions:
            self.update_device(pos, t, sync_only=True)
        self._advance(js, t)
        js.remaining = 0.0
        for pos in positions:
            js.intervals.append((pos, js._on, t))
        self.fleet.remove(js.job.job_id)
        del self.running[js.idx]
        js.state = 2
        js.finish = t
        js.positions = []
        js.speed = 0.0
        js.version += 1
        return positions

    def _advance(self, js: JobState, t: float) -> None:
        dt = t - js.last_t
        if dt > 0:
            done = js.speed * dt
            js.remaining -= done
            js.served += done
            js.attained += js.active * dt * js.job.gpus
            js.job.attained_s = js.attained
            js.job.remaining_s = max(0.0, js.remaining)
        js.last_t = t

    # ---- who runs on a device, how fast
    def lane_turns(self, lane_jobs: list[JobState]) -> tuple[dict[int, float], float | None]:
        """Each lane job's share of the lane's turns, and (las) how long until the order changes."""
        if len(lane_jobs) == 1:
            return {lane_jobs[0].idx: 1.0}, None
        kind = self.policy.lane_discipline
        if kind == LEAST_ATTAINED:
            # least attained first, continuously: the jobs tied for least share the lane's turns equally until
            # they catch up with the next one
            key = [(s.attained, s) for s in lane_jobs]
            low = min(k for k, _ in key)
            group = [s for k, s in key if k <= low + 1e-6]
            higher = [k for k, _ in key if k > low + 1e-6]
            share = 1.0 / len(group)
            wake = (min(higher) - low) / (share * group[0].job.gpus) if higher else None
            return {s.idx: share for s in group}, wake
        turns = [Turn(s.job.job_id, s.sim.arrival, s.sim.arrival, s.attained, s.job.remaining_s) for s in lane_jobs]
        return {self.by_id[k].idx: v for k, v in shares(kind, turns).items()}, None

    def update_device(self, pos: int, t: float, sync_only: bool = False) -> None:
        """Bring every job on device `pos` to time t, then (unless sync_only) recompute who runs and how fast."""
        device = self.fleet.devices[pos]
        states = [self.by_id[j] for j in device.jobs()]
        for js in states:
            self._advance(js, t)
        self._track(pos, t)
        if sync_only:
            return
        lanes_active: list[list[tuple[JobState, float]]] = []
        wake_at = None
        for lane in device.lanes.values():
            members = [self.by_id[j] for j in lane.jobs]
            turns, wake = self.lane_turns(members)
            running = []
            for js in members:
                js.active = turns.get(js.idx, 0.0)
                if js.active > 0:
                    running.append((js, js.active))
            lanes_active.append(running)
            if wake is not None:
                wake_at = wake if wake_at is None else min(wake_at, wake)
        # jobs of one lane take turns, so they do not slow each other: interference is between lanes
        speeds = self._speeds(lanes_active)
        for running, s in zip(lanes_active, speeds, strict=True):
            for js, share in running:
                js.speed = share * s
        for js in states:
            if js.active == 0:
                js.speed = 0.0
            if len(js.positions) > 1:  # a multi-device job runs at its slowest device's pace (all exclusive)
                js.speed = min(js.speed, 1.0) if js.active else 0.0
            js.version += 1
            if js.speed > 0:
                self.push(t + max(js.remaining, 0.0) / js.speed, DONE, js.idx, js.version)
        if wake_at is not None:
            self.push(t + wake_at, WAKE, pos)
        self._track(pos, t, recompute=True)

    def _speeds(self, lanes: list[list[tuple[JobState, float]]]) -> list[float]:
        """Speed of each lane's running job(s) next to the other lanes' running jobs."""
        if len(lanes) <= 1:
            return [1.0] * len(lanes)
        jobs = [js for lane in lanes for js, _ in lane]
        if all(js.sim.mem is None for js in jobs) and sum(js.sim.share for js in jobs) <= 1.0 + EPS:
            return [1.0] * len(lanes)  # quota-sized jobs within one device's compute: what the quota buys
        utils = [sum(js.sim.demand() * share for js, share in lane) for lane in lanes]
        if len(lanes) == 2:
            a, b = lanes
            models = None
            if len(a) == 1 and len(b) == 1 and a[0][0].sim.model and b[0][0].sim.model:
                models = (a[0][0].sim.model, b[0][0].sim.model)
            sa, sb = self.interference.slowdown(utils[0], utils[1], models)
            return [1.0 / sa, 1.0 / sb]
        return [1.0 / s for s in self.interference.slowdowns(utils)]

    # ---- integrals for the metrics
    def _track(self, pos: int, t: float, recompute: bool = False) -> None:
        tr = self.tracks[pos]
        dt = t - tr.last_t
        if dt > 0:
            self.integrals["busy"] += dt if tr.busy else 0.0
            self.integrals["util"] += tr.util * dt
            self.integrals["frag"] += tr.frag * dt
        tr.last_t = t
        if not recompute:
            return
        device = self.fleet.devices[pos]
        busy = device.n_jobs > 0
        if busy != tr.busy:
            self.n_busy += 1 if busy else -1
            self.busy_series.append((t, self.n_busy))
        tr.busy = busy
        util = 0.0
        for j in device.jobs():
            js = self.by_id[j]
            util += js.sim.demand() * js.speed
        tr.util = min(1.0, util)
        used = device.reserved / device.capacity if device.capacity else 1.0
        tr.frag = (1.0 - used) if busy and used < 1.0 - 1e-6 else 0.0

    def _flush(self, t: float) -> None:
        for pos in range(len(self.tracks)):
            self._track(pos, t)

    # ---- invariants (tests run every event with check=True)
    def check_state(self, positions: set[int] | None = None) -> None:
        """Assert the memory invariants on the devices that changed (all of them when None)."""
        for pos in sorted(positions) if positions is not None else range(len(self.fleet.devices)):
            device = self.fleet.devices[pos]
            device.check()
            total = 0
            for lane in device.lanes.values():
                members = [self.by_id[j] for j in lane.jobs]
                p = sum(lane.jobs[js.job.job_id].p_prime for js in members)
                e = max(lane.jobs[js.job.job_id].ephemeral for js in members)
                assert p + e <= lane.size, f"lane {lane.lane_id} on device {pos} holds {p + e} > {lane.size}"
                # the job's real bytes (P + E, before Salus's headroom) never exceed what its lane charged
                for js in members:
                    # (quota jobs: their lane is their share of the device, rounded down by a few bytes)
                    assert js.sim.mem_on(device.capacity) <= lane.size + 64, (js.job.job_id, lane)
                total += lane.size
            assert total <= device.capacity, f"device {pos}: lanes of {total} bytes > {device.capacity}"
            if device.n_jobs:
                assert sum(self.by_id[j].active > 0 for j in device.jobs()) >= 1, f"device {pos} holds but runs none"


def lane_job_count(sim: Simulation) -> int:
    return sum(d.n_jobs for d in sim.fleet.devices)


def isclose(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-3)
