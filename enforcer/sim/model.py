"""The simulator's inputs: jobs, nodes and a trace (jobs + cluster + what the reader skipped)."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from numbers import Integral, Real

from store.errors import InvalidInput

GIB = 1024**3


def _whole(value: object, least: int) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool) and int(value) >= least


def _finite(value: object) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True, slots=True)
class SimJob:
    """One job to replay.

    `work` is the job's run time alone on its devices (seconds); `share` the fraction of one device's compute
    it asks for (1.0 = the whole device; openb's gpu_milli / 1000); `mem` its peak device memory in bytes per
    device (None: memory in proportion to `share`, as openb's GPU-sharing pods are sized). `mem_persistent`
    and `mem_ephemeral` are Salus's P and E when known (lane admission); `model` names the job for the
    co-location table; `util` is its measured utilisation alone (0..1), used when the pair was not measured.
    """

    id: str
    arrival: float
    work: float
    gpus: int = 1
    share: float = 1.0
    mem: int | None = None
    mem_persistent: int | None = None
    mem_ephemeral: int | None = None
    model: str | None = None
    util: float | None = None
    steps: int | None = None

    def __post_init__(self) -> None:
        # a NaN time would sit in the event heap and stall the simulation, negative work would finish the job at once
        # with nothing served, gpus 0 would count none of its device time: such a job is refused, by name, up front
        bad = []
        if not _finite(self.arrival):
            bad.append(f"arrival {self.arrival!r} is not a finite number of seconds")
        if not _finite(self.work) or self.work < 0:
            bad.append(f"work {self.work!r} is not a finite number of seconds >= 0")
        if not _whole(self.gpus, 1):
            bad.append(f"gpus {self.gpus!r} is not a whole number >= 1")
        if not _finite(self.share) or not 0.0 < self.share <= 1.0:
            bad.append(f"share {self.share!r} is not a fraction of a device in (0, 1]")
        for name in ("mem", "mem_persistent", "mem_ephemeral"):
            value = getattr(self, name)
            if value is not None and not _whole(value, 0):
                bad.append(f"{name} {value!r} is not a whole number of bytes >= 0")
        if self.util is not None and (not _finite(self.util) or not 0.0 <= self.util <= 1.0):
            bad.append(f"util {self.util!r} is not a utilisation in 0..1")
        if self.steps is not None and not _whole(self.steps, 0):
            bad.append(f"steps {self.steps!r} is not a whole number >= 0")
        if bad:
            raise InvalidInput(f"job {self.id!r}: {'; '.join(bad)}; fix or drop it in the trace")

    @property
    def fractional(self) -> bool:
        return self.gpus == 1 and self.share < 1.0

    def mem_on(self, device_mem: int) -> int:
        """Bytes this job holds on a device of `device_mem` bytes."""
        if self.mem is not None:
            return self.mem
        return int(round(self.share * device_mem))

    def demand(self) -> float:
        """The fraction of one device's compute the job keeps busy: measured utilisation, else its share."""
        return self.util if self.util is not None else self.share


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """One node: `devices` devices of `mem` bytes each, of GPU model `model`."""

    name: str
    devices: int
    mem: int
    model: str = ""

    def __post_init__(self) -> None:
        if not _whole(self.devices, 0) or not _whole(self.mem, 0):
            raise InvalidInput(f"node {self.name!r}: {self.devices!r} devices of {self.mem!r} bytes; give a whole "
                               "number of devices >= 0 and of bytes >= 0")


@dataclass(slots=True)
class ReadReport:
    """What a reader read: rows seen, jobs made, and rows skipped by reason (malformed rows are counted here)."""

    source: str
    rows: int = 0
    jobs: int = 0
    skipped: Counter[str] = field(default_factory=Counter)

    def skip(self, reason: str, n: int = 1) -> None:
        if n:
            self.skipped[reason] += n

    def as_dict(self) -> dict:
        return {"source": self.source, "rows": self.rows, "jobs": self.jobs, "skipped": dict(self.skipped)}


@dataclass(slots=True)
class Trace:
    """Jobs to replay on a cluster. `cluster` is None when the trace does not say (the caller gives one)."""

    kind: str
    jobs: list[SimJob]
    cluster: list[NodeSpec] | None
    report: ReadReport
    notes: dict = field(default_factory=dict)

    def subset(self, n: int) -> Trace:
        """The first `n` jobs by arrival (tests run a subset; benchmarks run the whole trace)."""
        jobs = sorted(self.jobs, key=lambda j: (j.arrival, j.id))[:n]
        return Trace(self.kind, jobs, self.cluster, self.report, dict(self.notes))


def uniform_cluster(nodes: int, devices_per_node: int, mem: int, model: str = "") -> list[NodeSpec]:
    """`nodes` identical nodes (the `--nodes N[xD[xMEM_GIB]]` shape of the CLI)."""
    return [NodeSpec(f"node-{i:04d}", devices_per_node, mem, model) for i in range(nodes)]
