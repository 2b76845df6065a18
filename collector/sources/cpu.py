"""The `cpu` device source: on a machine without GPUs, each group of CPU cores is one device (psutil, real).

- Devices: the logical cores in groups of `cores_per_device` (Settings.cpu_cores_per_device, default 1);
  the last group may be smaller. A device's utilisation (stored as gpu_util) is the mean utilisation of its
  cores; its memory total is its share of host RAM (cores in the group / all cores), and its memory used is
  measured: the resident memory (RSS) of the processes pinned to its cores (CPU affinity within the machine, the
  way the enforcer starts managed jobs), 0 when none is. Processes free to run anywhere count on no device.
- Processes: a process whose CPU affinity is narrower than the machine (the enforcer pins managed jobs
  that way) belongs to the device holding most of its allowed cores; any other process to the device
  whose cores hold the core it last ran on (psutil `cpu_num`), which is where its recent activity put it.
  Per device the source reports (a) every *marked* process, FLEETLENS_WORKFLOW or FLEETLENS_MANAGED in
  its environment (read once per process), even when idle, so a managed job's idleness is visible; and
  (b) the `top_n` other processes by CPU use above `min_util` of one core. cpu_util is the time the process
  wanted a core over the interval, as a fraction of the device's cores (clipped to 1: a multi-threaded job on
  a one-core device shows 1.0): its CPU time plus the time its threads waited, runnable, on a run queue
  (collector.sources.run_queue). On a GPU the job's utilisation is the time its kernels kept the GPU busy; the
  CPU analogue is the time the job was running or ready to run, because a core taken by other tenants is
  contention, not the job's idleness: a busy job sharing its core with three others reads ~1, not ~0.25. The
  waiting time is read for marked processes and for those whose CPU time alone reaches `min_util`; without
  schedstat in the kernel the figure is CPU time alone. mem_used is its RSS. A process's first sample has no
  interval yet: it is reported (if marked) with cpu_util missing.
- Processes that vanish between listing and reading, or deny access, are skipped quietly.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil

from collector.sources.base import DeviceInfo, DeviceReading, ProcessReading
from collector.sources.run_queue import ThreadDelays, delay_growth, thread_delays
from store.errors import ConfigError

MARKERS = ("FLEETLENS_WORKFLOW", "FLEETLENS_MANAGED")
AFFINITY_EVERY = 10
_GONE = (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, ProcessLookupError, PermissionError)


@dataclass
class _Tracked:
    proc: psutil.Process
    marked: bool
    start_time: float
    last_cpu: float | None = None  # user+system CPU seconds at the previous scan
    last_wall: float = 0.0  # monotonic time of the previous scan
    last_delays: ThreadDelays | None = None  # run-queue delay per thread at the previous scan, when it was read
    pinned: int | None = None  # the device its CPU affinity confines it to, if any
    affinity_age: int = -1  # samples since the affinity was read (re-read every AFFINITY_EVERY)


def core_groups(n_cores: int, cores_per_device: int) -> list[tuple[int, ...]]:
    if cores_per_device < 1:
        raise ConfigError(f"FLEETLENS_CPU_CORES_PER_DEVICE must be at least 1, not {cores_per_device}")
    return [tuple(range(s, min(s + cores_per_device, n_cores))) for s in range(0, n_cores, cores_per_device)]


def _is_marked(proc: psutil.Process) -> bool:
    try:
        env = proc.environ()
    except _GONE:
        return False
    return any(env.get(m) for m in MARKERS)


class CpuSource:
    """A DeviceSource over groups of this machine's CPU cores."""

    name = "cpu"

    def __init__(
        self,
        *,
        cores_per_device: int = 1,
        host_id: str | None = None,
        top_n: int = 8,
        min_util: float = 0.01,
        clock: Callable[[], float] = time.time,
    ) -> None:
        n_cores = psutil.cpu_count(logical=True) or 1
        self.groups = core_groups(n_cores, cores_per_device)
        self.host_id = host_id or socket.gethostname()
        self.top_n, self.min_util, self._clock = top_n, min_util, clock
        self._device_of_core = {c: i for i, g in enumerate(self.groups) for c in g}
        self._ram_total = psutil.virtual_memory().total
        self._infos = [
            DeviceInfo(
                index=i,
                # uuids are unique in the store: two agents on one machine (different host ids) must not collide
                uuid=f"cpu:{self.host_id}:{g[0]}-{g[-1]}",
                name=f"cpu core {g[0]}" if len(g) == 1 else f"cpu cores {g[0]}-{g[-1]}",
                memory_total=self._ram_total * len(g) // n_cores,
                cpu_cores=g,
            )
            for i, g in enumerate(self.groups)
        ]
        self._n_cores = n_cores
        self._tracked: dict[tuple[int, float], _Tracked] = {}
        self._self_pid = os.getpid()
        psutil.cpu_percent(percpu=True)  # start the interval the first sample measures
        self._scan()

    def devices(self) -> list[DeviceInfo]:
        return list(self._infos)

    def _scan(self) -> list[tuple[_Tracked, float | None, int | None, int | None]]:
        """(tracked, percent of one core wanted (running or runnable) or None, core it last ran on, rss) for every
        readable process."""
        out = []
        live: set[tuple[int, float]] = set()
        now = time.monotonic()
        # one pass reads each process's stat and statm once (psutil's oneshot under process_iter)
        for proc in psutil.process_iter(["create_time", "cpu_times", "cpu_num", "memory_info"], ad_value=None):
            if proc.pid == self._self_pid:
                continue
            info = proc.info
            if info["create_time"] is None or info["cpu_times"] is None:
                continue  # vanished or denied while listed
            key = (proc.pid, info["create_time"])
            tracked = self._tracked.get(key)
            if tracked is None:
                tracked = self._tracked[key] = _Tracked(proc, _is_marked(proc), key[1])
            cpu_total = info["cpu_times"].user + info["cpu_times"].system
            percent = None
            if tracked.last_cpu is not None and now > tracked.last_wall:
                percent = max(cpu_total - tracked.last_cpu, 0.0) / (now - tracked.last_wall) * 100.0
            delays = None
            if tracked.marked or (percent is not None and percent >= self.min_util * 100.0):
                delays = thread_delays(proc.pid)
                if percent is not None and delays is not None and tracked.last_delays is not None:
                    percent += delay_growth(tracked.last_delays, delays) / (now - tracked.last_wall) * 100.0
            tracked.last_cpu, tracked.last_wall, tracked.last_delays = cpu_total, now, delays
            tracked.affinity_age += 1
            if tracked.affinity_age % AFFINITY_EVERY == 0:
                try:
                    tracked.pinned = self._pinned_device(proc.cpu_affinity())
                except _GONE:
                    continue
            live.add(key)
            rss = info["memory_info"].rss if info["memory_info"] is not None else None
            out.append((tracked, percent, info["cpu_num"], rss))
        for key in set(self._tracked) - live:
            del self._tracked[key]
        return out

    def _pinned_device(self, affinity: list[int]) -> int | None:
        """The device whose cores hold most of a process's allowed cores, when it is not allowed everywhere."""
        if not affinity or len(affinity) >= self._n_cores:
            return None
        counts: dict[int, int] = {}
        for c in affinity:
            d = self._device_of_core.get(c)
            if d is not None:
                counts[d] = counts.get(d, 0) + 1
        return max(counts, key=lambda d: (counts[d], -d)) if counts else None

    def sample(self) -> list[DeviceReading]:
        now = self._clock()
        per_core = psutil.cpu_percent(percpu=True)
        scanned = self._scan()
        pinned_rss = [0] * len(self._infos)
        for tracked, _, _, rss in scanned:
            if tracked.pinned is not None and rss is not None:
                pinned_rss[tracked.pinned] += rss
        readings = []
        for info in self._infos:
            cores = [per_core[c] for c in info.cpu_cores or () if c < len(per_core)]
            util = sum(cores) / len(cores) / 100.0 if cores else None
            readings.append(DeviceReading(index=info.index, ts=now, gpu_util=util, mem_used=pinned_rss[info.index],
                                          mem_total=info.memory_total))
        candidates: list[list[tuple[float, ProcessReading, bool]]] = [[] for _ in self._infos]
        for tracked, percent, core, rss in scanned:
            device = tracked.pinned
            if device is None:
                device = self._device_of_core.get(core) if core is not None else None
            if device is None:
                continue
            n = len(self.groups[device])
            util = None if percent is None else min(percent / 100.0 / n, 1.0)
            reading = ProcessReading(pid=tracked.proc.pid, mem_used=rss, cpu_util=util,
                                     start_time=tracked.start_time)
            candidates[device].append((util or 0.0, reading, tracked.marked))
        for device, found in enumerate(candidates):
            marked = [r for _, r, m in found if m]
            busy = sorted(((u, r) for u, r, m in found if not m and u >= self.min_util / len(self.groups[device])),
                          key=lambda x: -x[0])
            readings[device].processes = marked + [r for _, r in busy[: self.top_n]]
        return readings

    def close(self) -> None:
        self._tracked.clear()
