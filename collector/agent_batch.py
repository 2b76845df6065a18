"""What the agent holds between two flushes: the batch of sample rows (as spooled, by device index), the processes it
saw, and the counters a test or `--once` reads back."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from operator import attrgetter, itemgetter
from typing import Any

from collector.command_runner import Outcome
from collector.sdk_step_writer import RefusedCounts
from collector.sources.base import DeviceReading
from store.samples import DEVICE_METRICS, DEVICE_SAMPLE_COLUMNS, PROCESS_METRICS, PROCESS_SAMPLE_COLUMNS

BATCH_VERSION = 1

# A sample row in memory and in the spool names its device by index on the host, not by id in the store:
# the agent can sample (and spool) before it ever reached the database to learn its device ids. A row is
# [device index, *FIELDS]; the batch names its fields, so a spooled batch is read by name, whatever the order, and
# its devices' UUIDs, so it finds them after a reboot that numbered them otherwise.
DEVICE_FIELDS: tuple[str, ...] = ("ts", *DEVICE_METRICS)
PROCESS_FIELDS: tuple[str, ...] = ("workflow_id", "pid", "ts", *PROCESS_METRICS)
device_metrics = attrgetter(*DEVICE_METRICS)
process_metrics = attrgetter(*PROCESS_METRICS)


@dataclass
class AgentStats(RefusedCounts):
    """Counters a test or `--once` can read back (and what the database refused of the job SDK's rows)."""

    rounds: int = 0  # sampling rounds
    device_rows: int = 0  # device sample rows taken
    process_rows: int = 0
    flushes: int = 0
    batches_written: int = 0  # batches the database took directly
    batches_spooled: int = 0
    batches_resent: int = 0  # spooled batches later sent
    # writes another writer's locks stopped (DatabaseBusy): their batch waits in the spool for the next flush, and
    # the database is not taken for down (commands go on being polled)
    busy_writes: int = 0
    rows_dropped: int = 0  # rows that could not be written (unknown device)
    # metric values a source read as NaN or infinite (a GPM rate over no time, say): each is stored as not reported
    # (NULL), its row kept; one in a batch made the spool refuse the whole batch, and the flush lose it
    nonfinite_values: int = 0
    sample_errors: int = 0
    commands: list[Outcome] = field(default_factory=list)
    # stale copies of managed jobs this agent stopped, each as collector.job_fence.fence reports it
    fenced: list[dict[str, Any]] = field(default_factory=list)
    # seconds each fresh batch took to write, the latest ones (a load test reads the percentiles)
    write_s: deque[float] = field(default_factory=lambda: deque(maxlen=4096))


@dataclass
class KnownProcess:
    """What the agent knows of one process it saw on a device."""

    pid: int
    start_time: float
    workflow_id: str
    id_source: str
    cmdline: str | None = None
    username: str | None = None
    checked_at: float = 0.0


class Batch:
    """Rows taken since the last flush, plus the workflows and processes they refer to."""

    def __init__(self) -> None:
        self.devices: list[list[Any]] = []
        self.processes: list[list[Any]] = []
        self.workflows: dict[str, str] = {}  # workflow id -> id_source
        self.seen: dict[int, KnownProcess] = {}
        self.lost: set[int] = set()
        self.found: set[int] = set()  # devices that answered again after being lost

    @property
    def rows(self) -> int:
        return len(self.devices) + len(self.processes)

    def to_json(self, host_id: str, uuids: Mapping[int, str] | None = None) -> dict[str, Any]:
        """The batch as spooled; `uuids` (device index -> UUID, as the source numbers its devices now) lets a batch
        sent after a reboot that numbered the devices otherwise find its rows' devices."""
        indexes = {row[0] for row in self.devices} | {row[0] for row in self.processes}
        return {
            "v": BATCH_VERSION, "host_id": host_id, "device_fields": list(DEVICE_FIELDS),
            "process_fields": list(PROCESS_FIELDS), "devices": self.devices, "processes": self.processes,
            "workflows": self.workflows,
            "device_uuids": {str(i): u for i, u in (uuids or {}).items() if i in indexes},
        }


def finite(values: tuple[Any, ...]) -> tuple[list[Any], int]:
    """The metric values with each NaN or infinite one made None (not reported, as store.samples has a metric a
    source could not read), and how many were. JSON (the spool) has no NaN, and the two databases would keep one
    differently (SQLite as NULL, PostgreSQL as NaN, which every mean over it then is)."""
    out = list(values)
    bad = 0
    for i, v in enumerate(out):
        if isinstance(v, float) and not math.isfinite(v):
            out[i] = None
            bad += 1
    return out, bad


def device_row(r: DeviceReading) -> tuple[list[Any], int]:
    """The reading's batch row, and how many of its metrics were not finite (made None)."""
    metrics, bad = finite(device_metrics(r))
    return [r.index, r.ts, *metrics], bad


def row_getter(columns: tuple[str, ...], names: tuple[str, ...]) -> Callable[[tuple[Any, ...]], tuple[Any, ...]]:
    """A function taking a row whose values are `names` to the tuple of `columns` (all of which it must name)."""
    return itemgetter(*[names.index(c) for c in columns])


def sample_rows(payload: dict[str, Any],
                ids: dict[int, int]) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]], int]:
    """A batch's (fresh or spooled) device and process rows in the sample rows' column order, with the store's device
    ids (`ids`: device index -> id), and how many rows named a device index `ids` does not know (dropped)."""
    host_id = payload["host_id"]
    # Rows as tuples in the sample rows' column order, picked by name: no per-row dict on the hot path.
    # A batch row with its store keys in front, (device_id, host_id, *row[1:]), is read by one itemgetter.
    device_rows, process_rows, dropped = [], [], 0
    # A batch spooled by an agent of another version may lack metrics (added since) or carry some this one has not
    # (removed since): the lacking ones are NULL (not reported), the others left out.
    device_names = ("device_id", "host_id", *payload["device_fields"])
    process_names = ("device_id", "host_id", *payload["process_fields"])
    device_pad = tuple(None for m in DEVICE_METRICS if m not in device_names)
    process_pad = tuple(None for m in PROCESS_METRICS if m not in process_names)
    to_device_row = row_getter(DEVICE_SAMPLE_COLUMNS,
                               device_names + tuple(m for m in DEVICE_METRICS if m not in device_names))
    to_process_row = row_getter(PROCESS_SAMPLE_COLUMNS,
                                process_names + tuple(m for m in PROCESS_METRICS if m not in process_names))
    for row in payload["devices"]:
        device_id = ids.get(row[0])
        if device_id is None:
            dropped += 1
            continue
        device_rows.append(to_device_row((device_id, host_id, *row[1:], *device_pad)))
    for row in payload["processes"]:
        device_id = ids.get(row[0])
        if device_id is None:
            dropped += 1
            continue
        process_rows.append(to_process_row((device_id, host_id, *row[1:], *process_pad)))
    return device_rows, process_rows, dropped

