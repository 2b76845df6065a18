"""fleetlens's own telemetry export format: a time range of hosts, devices, workflows, processes and samples.

Two encodings of one record stream, chosen by the file name:

- ``*.jsonl.gz`` / ``*.jsonl`` (default): JSON lines; the first line is the header
  ``{"kind": "fleetlens-export", "version": 1, ...}``, every other line one record with a ``kind`` of
  ``host | device | workflow | process | device_sample | process_sample``.
- ``*.csv.gz`` / ``*.csv``: one CSV table whose columns are ``kind`` plus the union of every kind's fields
  (``EXPORT_COLUMNS``); a field a kind does not have is empty; JSON-valued fields (labels, cpu_cores) are JSON text.

Devices are named by (host_id, device index), never by database ids, so a file loads into any store
(collector.recordings.load) or plays live (collector.sources.replay). Written by export_writer, read by
export_reader.
"""

from __future__ import annotations

from pathlib import Path

from store.samples import DEVICE_METRICS, INT_METRICS, PROCESS_METRICS

FORMAT = "fleetlens-export"
VERSION = 1

# kind -> (required fields, optional fields)
FIELDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "host": (("id",), ("hostname", "source", "labels")),
    "device": (("host_id", "index", "uuid"), ("name", "source", "memory_total", "cpu_cores")),
    "workflow": (
        ("id",),
        ("id_source", "name", "owner", "team", "labels", "managed", "movable", "gpus", "state", "created_at",
         "last_seen", "mem_persistent", "mem_ephemeral", "declared_steps"),
    ),
    "process": (("host_id", "pid", "start_time", "workflow_id"),
                ("cmdline", "username", "first_seen", "last_seen", "ended_at")),
    "device_sample": (("host_id", "device_index", "ts"), DEVICE_METRICS),
    "process_sample": (("host_id", "device_index", "workflow_id", "pid", "ts"), PROCESS_METRICS),
}
EXPORT_COLUMNS: tuple[str, ...] = ("kind", *dict.fromkeys(f for req, opt in FIELDS.values() for f in (*req, *opt)))
JSON_FIELDS = frozenset({"labels", "cpu_cores"})
INT_FIELDS = frozenset({"index", "device_index", "pid", "memory_total", "gpus", "mem_persistent", "mem_ephemeral",
                        "declared_steps", *INT_METRICS})
FLOAT_FIELDS = frozenset({"ts", "start_time", "created_at", "last_seen", "first_seen", "ended_at",
                          *(c for c in (*DEVICE_METRICS, *PROCESS_METRICS) if c not in INT_FIELDS)})
BOOL_FIELDS = frozenset({"managed", "movable"})
STR_FIELDS = frozenset({"id", "host_id", "uuid", "workflow_id"})


def format_of(path: Path) -> str:
    name = path.name.lower()
    return "csv" if name.endswith((".csv", ".csv.gz")) else "jsonl"
