"""What a Slurm job's SDK leaves in its checkpoint folder for the Slurm actuator to read: the manifest of its latest
checkpoint (step, size, sha256, written for which signal) and where each start of the job began (its restart count,
its step, the GPUs it was given). Files, not a socket: the enforcer and the job meet only in the shared checkpoint
location, as on a cluster where no fleetlens agent runs on the nodes."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

import fsspec

from store.checkpoints import location_for
from store.errors import InvalidInput
from store.settings import Settings

CHECKPOINT_MANIFEST = "fleetlens-checkpoint.json"
STARTED = "fleetlens-started.json"


@dataclass(frozen=True)
class CheckpointManifest:
    job_id: int
    restart_count: int
    step: int  # the next step to run after restoring it
    path: str
    size_bytes: int
    sha256: str
    written_at: float
    signal_at: float | None = None  # when the checkpoint signal that asked for it arrived


@dataclass(frozen=True)
class Started:
    job_id: int
    restart_count: int
    step: int  # the step it began at (0, or the step of the checkpoint it restored)
    gpus: str  # CUDA_VISIBLE_DEVICES as Slurm gave it
    started_at: float
    restored_sha256: str | None = None


def job_folder(settings: Settings, workflow_id: str) -> str:
    """The workflow's checkpoint location: under FLEETLENS_CHECKPOINT_URL when set, else under FLEETLENS_HOME
    (which the enforcer reads only when it shares the nodes' filesystem)."""
    return location_for(settings.checkpoint_url or str(settings.checkpoint_dir), workflow_id)


def write_mark(folder: str, name: str, mark: CheckpointManifest | Started) -> None:
    """Write a mark whole or not at all (a temporary file, then a rename where the filesystem has one)."""
    fs, path = fsspec.core.url_to_fs(folder)
    fs.makedirs(path, exist_ok=True)
    tmp, final = f"{path}/.{name}.tmp", f"{path}/{name}"
    fs.pipe_file(tmp, json.dumps(asdict(mark)).encode())
    fs.mv(tmp, final)


def read_mark(folder: str, name: str) -> dict[str, Any] | None:
    fs, path = fsspec.core.url_to_fs(folder)
    target = f"{path}/{name}"
    try:
        raw = fs.cat_file(target)
    except FileNotFoundError:
        return None
    try:
        doc = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise InvalidInput(f"{target} is not the JSON the fleetlens SDK writes ({exc})") from None
    return doc if isinstance(doc, dict) else None


def read_manifest(folder: str) -> CheckpointManifest | None:
    doc = read_mark(folder, CHECKPOINT_MANIFEST)
    return None if doc is None else CheckpointManifest(**doc)


def read_started(folder: str) -> Started | None:
    doc = read_mark(folder, STARTED)
    return None if doc is None else Started(**doc)
