"""The simulator's inputs: jobs, nodes and a trace (jobs + cluster + what the reader skipped)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

GIB = 1024**3


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
