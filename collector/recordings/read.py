"""Any recording read whole: "alibaba" (the trace in FLEETLENS_FLEET_DATA_DIR), its folder, or a fleetlens export.

Malformed rows are skipped, counted, and reported in one log warning; the rest is read.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from collector.recordings.alibaba import (
    ALIBABA_DUTY_FILE,
    ALIBABA_MEMORY_FILE,
    ALIBABA_MEMORY_TOTAL,
    DEFAULT_TEAMS,
    read_alibaba,
)
from collector.recordings.export_reader import read_export
from collector.recordings.recording import Recording
from store.errors import InvalidInput

log = logging.getLogger(__name__)


def resolve(path_or_kind: str | Path, fleet_data_dir: Path | None = None) -> tuple[str, Path]:
    """("alibaba" | "export", path) for "alibaba" (the trace in `fleet_data_dir`, FLEETLENS_FLEET_DATA_DIR as the
    entry point passes it), an Alibaba folder or file, or an export file."""
    if isinstance(path_or_kind, str) and path_or_kind == "alibaba":
        if fleet_data_dir is None:
            raise InvalidInput("'alibaba' names the trace in the fleet's data folder, and none was given; give the "
                               "folder of the Alibaba GenAI trace instead")
        return "alibaba", Path(fleet_data_dir)
    path = Path(path_or_kind)
    if path.is_dir():
        if (path / ALIBABA_DUTY_FILE).exists():
            return "alibaba", path
        raise InvalidInput(f"{path} holds no {ALIBABA_DUTY_FILE}; give the folder of the Alibaba GenAI trace")
    if not path.exists():
        raise InvalidInput(f"replay file {path} does not exist; give 'alibaba', its folder, or a fleetlens export")
    if path.name in (ALIBABA_DUTY_FILE, ALIBABA_MEMORY_FILE):
        return "alibaba", path.parent
    return "export", path


def read_recording(
    path_or_kind: str | Path,
    *,
    devices_per_host: int = 8,
    memory_total: int = ALIBABA_MEMORY_TOTAL,
    teams: Sequence[str] | None = DEFAULT_TEAMS,
    containers: int | None = None,
    fleet_data_dir: Path | None = None,
) -> Recording:
    """Read a whole recording; `containers` keeps only the first N Alibaba containers (tests, small demos)."""
    kind, path = resolve(path_or_kind, fleet_data_dir)
    if kind == "alibaba":
        rec = read_alibaba(path, devices_per_host=devices_per_host, memory_total=memory_total, teams=teams,
                           containers=containers)
    else:
        rec = read_export(path)
    if rec.skipped:
        log.warning("replay %s: skipped %d malformed rows (%s); played the rest", path, sum(rec.skipped.values()),
                    ", ".join(f"{k}: {v}" for k, v in sorted(rec.skipped.items())))
    return rec
