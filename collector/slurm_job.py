"""The job SDK under Slurm: the checkpoint signal (SIGUSR1, from `scancel --batch --signal=USR1` or `sbatch
--signal=B:USR1@N`) makes the job checkpoint at its next step boundary and write the checkpoint's manifest (step,
size, sha256); a requeued job resumes from that manifest's checkpoint, checked against its sha256, and every start
writes where it began. The Slurm actuator reads both files (store.slurm_marks). Outside Slurm nothing here runs."""

from __future__ import annotations

import hashlib
import logging
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from store.errors import ConfigError
from store.settings import Settings
from store.slurm_marks import (
    CHECKPOINT_MANIFEST,
    STARTED,
    CheckpointManifest,
    Started,
    job_folder,
    read_manifest,
    write_mark,
)

log = logging.getLogger(__name__)


def _sha256(path: Path) -> tuple[str, int]:
    h, size = hashlib.sha256(), 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


class SlurmSide:
    """One Slurm job's checkpoint signal and marks; made by the SDK when SLURM_JOB_ID is set."""

    def __init__(self, settings: Settings, workflow_id: str) -> None:
        assert settings.slurm_job_id is not None
        self.job_id = settings.slurm_job_id
        self.restart_count = settings.slurm_restart_count
        self.gpus = settings.cuda_visible_devices or ""
        self.folder = job_folder(settings, workflow_id)
        self.signal_at: float | None = None
        self.restored_sha256: str | None = None

    @classmethod
    def from_settings(cls, settings: Settings, workflow_id: str) -> SlurmSide | None:
        return cls(settings, workflow_id) if settings.slurm_job_id is not None else None

    def install(self) -> None:
        """Catch SIGUSR1 (main thread only: Python handles signals there)."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGUSR1, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.signal_at = time.time()

    @property
    def asked(self) -> bool:
        return self.signal_at is not None

    def resume_path(self) -> Path | None:
        """The checkpoint to restore when this job was requeued after writing one: its manifest's file, whose sha256
        must still match (a torn or replaced file stops the job rather than resuming from something else)."""
        manifest = read_manifest(self.folder)
        if manifest is None or manifest.job_id != self.job_id:
            return None
        path = Path(manifest.path)
        if not path.is_file():
            raise ConfigError(f"the checkpoint {path} that job {self.job_id}'s manifest names is missing; restore it "
                              f"or remove {self.folder}/{CHECKPOINT_MANIFEST} to start from step 0")
        sha, _ = _sha256(path)
        if sha != manifest.sha256:
            raise ConfigError(f"the checkpoint {path} does not match the sha256 its manifest recorded; it was changed "
                              f"after it was written. Remove {self.folder}/{CHECKPOINT_MANIFEST} to start from step 0")
        self.restored_sha256 = sha
        return path

    def started(self, step: int) -> None:
        write_mark(self.folder, STARTED, Started(job_id=self.job_id, restart_count=self.restart_count, step=step,
                                                 gpus=self.gpus, started_at=time.time(),
                                                 restored_sha256=self.restored_sha256))

    def checkpoint(self, save: Callable[[str], Any] | None, step: int) -> None:
        """Run the job's checkpoint callback into its folder and write the manifest; a failure is logged and the
        manifest left as it was (the actuator then times out and changes nothing)."""
        signal_at, self.signal_at = self.signal_at, None
        if save is None:
            log.warning("SIGUSR1 asked for a checkpoint, but this job passed no checkpoint callback")
            return
        folder = Path(self.folder)
        folder.mkdir(parents=True, exist_ok=True)
        try:
            returned = save(str(folder))
            path = Path(returned) if returned is not None else None
            if path is None or not path.is_file():
                raise ValueError(f"the checkpoint callback returned {returned!r}, not the file it wrote")
            sha, size = _sha256(path)
        except Exception as exc:
            log.warning("checkpoint on SIGUSR1 failed: %s", exc)
            return
        write_mark(self.folder, CHECKPOINT_MANIFEST, CheckpointManifest(
            job_id=self.job_id, restart_count=self.restart_count, step=step, path=str(path), size_bytes=size,
            sha256=sha, written_at=time.time(), signal_at=signal_at))
