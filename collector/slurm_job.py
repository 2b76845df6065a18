"""The job SDK under Slurm: the checkpoint signal (SIGUSR1, from `scancel --batch --signal=USR1` or `sbatch
--signal=B:USR1@N`) makes the job checkpoint at its next step boundary and write the checkpoint's manifest (step,
size, sha256); a requeued job resumes from that manifest's checkpoint, checked against its sha256, and every start
writes where it began. The Slurm actuator reads both files (store.slurm_marks). Outside Slurm nothing here runs.

The start mark also carries the job's opt-in (FLEETLENS_MOVABLE or `job(movable=True)`: the importer and the actuator
count it beside `--comment=fleetlens:movable`) and its memory cap. A job on `shard:N` of a GPU Slurm splits into S
shards holds N/S of it, so its SDK caps its CUDA memory at that share, as a fleetlens lane job is capped at its
lane's: N is SLURM_SHARDS_ON_NODE (over the GPUs in CUDA_VISIBLE_DEVICES), S the node's shards over its GPUs from
its NodeName line in slurm.conf (SLURM_CONF, read as a file on the node: no call to slurmctld, which a training
job should not depend on; where they do not divide evenly, S is its own GPU's, by SLURM_JOB_GPUS), or
FLEETLENS_SLURM_SHARDS_PER_GPU where the job cannot read slurm.conf. An explicit
FLEETLENS_MEMORY_FRACTION wins. Anything missing or unreadable means no cap, with the reason logged and in the
mark.

The start mark says too whether this process is the batch step's own (`batch_step`): `scancel --batch --signal=USR1`
signals that process alone, so a training run that the batch script starts as its child (no `exec`, or `srun`)
never sees the signal, and the script, which does not catch SIGUSR1, dies of it. The actuator signals only a job
whose mark says it is."""

from __future__ import annotations

import hashlib
import logging
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from store.errors import ConfigError, InvalidInput
from store.settings import Settings
from store.slurm import conf_node_gres, read_slurm_conf, shard_share, shards_by_gpu
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


def shards_per_gpu(settings: Settings) -> tuple[int | None, str]:
    """(the shards each GPU this job holds is split into, where that came from or why it is not known). Slurm may
    spread a node's shards unevenly (store.slurm.shards_by_gpu); then the job's own GPUs (SLURM_JOB_GPUS, the node's
    indices) say which count is its, and the most of them where its GPUs differ."""
    if settings.slurm_shards_per_gpu is not None:
        return settings.slurm_shards_per_gpu, "FLEETLENS_SLURM_SHARDS_PER_GPU"
    node = settings.slurmd_nodename
    if not node:
        return None, "SLURMD_NODENAME is not set, so the node's shards cannot be looked up"
    try:
        counts = conf_node_gres(read_slurm_conf(settings.slurm_conf), node)
    except (OSError, UnicodeDecodeError) as exc:
        return None, (f"slurm.conf ({settings.slurm_conf}) cannot be read ({exc}); set FLEETLENS_SLURM_SHARDS_PER_GPU "
                      "for jobs on nodes that cannot read it")
    except InvalidInput as exc:
        return None, str(exc)
    if counts is None:
        return None, f"{settings.slurm_conf} has no NodeName line for node {node}"
    gpus, shards = counts
    if not gpus or not shards:
        return None, f"{settings.slurm_conf} gives node {node} {gpus} GPU(s) and {shards} shard(s)"
    source = f"{settings.slurm_conf}: node {node} has {shards} shards on {gpus} GPUs"
    if shards % gpus == 0:
        return shards // gpus, source
    spread = shards_by_gpu(gpus, shards)
    held = [g.strip() for g in (settings.slurm_job_gpus or "").split(",") if g.strip()]
    if not held or not all(g.isdigit() and int(g) < gpus and spread[int(g)] for g in held):
        return None, (f"{source}, spread unevenly ({', '.join(map(str, spread))}), and SLURM_JOB_GPUS "
                      f"({settings.slurm_job_gpus!r}) does not name GPUs of them with shards")
    mine = [spread[int(g)] for g in held]
    return max(mine), f"{source}, GPU(s) {','.join(held)} split into {', '.join(map(str, mine))}"


def memory_cap(settings: Settings) -> tuple[float | None, str]:
    """(the fraction of each GPU this job may use, None for no cap; and where it came from, or why there is none)."""
    if settings.memory_fraction is not None:
        return settings.memory_fraction, "FLEETLENS_MEMORY_FRACTION"
    raw = settings.slurm_shards_on_node
    if raw is None:
        return None, "not a shard job (Slurm set no SLURM_SHARDS_ON_NODE)"
    if not raw.strip().isdigit() or int(raw) < 1:
        return None, f"SLURM_SHARDS_ON_NODE is {raw!r}, not a number of shards"
    gpus = [g for g in (settings.cuda_visible_devices or "").split(",") if g.strip()]
    if not gpus:
        return None, "Slurm gave this shard job no GPU (CUDA_VISIBLE_DEVICES is empty)"
    per_gpu, source = shards_per_gpu(settings)
    if per_gpu is None:
        return None, source
    shards = int(raw)
    return shard_share(shards, len(gpus), per_gpu), f"{shards} shard(s) on {len(gpus)} GPU(s) of {per_gpu} ({source})"


def is_batch_step(job_id: int, process: psutil.Process | None = None) -> bool | None:
    """Whether `process` (this one by default) is Slurm job `job_id`'s batch step's own process: its parent is the
    step daemon of the batch step (`slurmstepd: [<id>.batch]`), as when the batch script exec'd it. A child of the
    script has the script as its parent; a task of `srun` has the daemon of another step (`[<id>.0]`). None when
    the process table cannot be read."""
    try:
        parent = (process or psutil.Process()).parent()
        if parent is None:
            return False
        return parent.name() == "slurmstepd" and f"[{job_id}.batch]" in " ".join(parent.cmdline())
    except (psutil.Error, OSError):
        return None


class SlurmSide:
    """One Slurm job's checkpoint signal and marks; made by the SDK when SLURM_JOB_ID is set."""

    def __init__(self, settings: Settings, workflow_id: str, *, movable: bool = False) -> None:
        assert settings.slurm_job_id is not None
        self.job_id = settings.slurm_job_id
        self.restart_count = settings.slurm_restart_count
        self.gpus = settings.cuda_visible_devices or ""
        self.folder = job_folder(settings, workflow_id)
        self.movable = movable
        self.memory_fraction, self.memory_note = memory_cap(settings)
        self.signal_at: float | None = None
        self.restored_sha256: str | None = None
        self.batch_step = is_batch_step(self.job_id)
        if self.movable and self.batch_step is not True:
            log.warning("fleetlens under Slurm: job %s's SDK is %s the batch step's own process, so fleetlens will "
                        "not send it the checkpoint signal (it would kill the batch script); run it with `exec python "
                        "...` in the batch script to let fleetlens move it", self.job_id,
                        "not" if self.batch_step is False else "not known to be")

    @classmethod
    def from_settings(cls, settings: Settings, workflow_id: str, *, movable: bool = False) -> SlurmSide | None:
        return cls(settings, workflow_id, movable=movable) if settings.slurm_job_id is not None else None

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
        must still match (a torn or replaced file stops the job rather than resuming from something else). Only a
        manifest of an earlier run of the job counts (a lower restart count: a requeue comes after the checkpoint):
        one of this run's count or higher was left by another job under a reused id (a new job's first run has
        restart count 0), and restoring it would train on another job's weights."""
        manifest = read_manifest(self.folder)
        if manifest is None or manifest.job_id != self.job_id:
            return None
        if manifest.restart_count >= self.restart_count:
            log.warning("fleetlens under Slurm: job %s (run %d) finds a checkpoint manifest of run %d under its id in "
                        "%s: not one of its earlier runs (another job under a reused id); starting without it",
                        self.job_id, self.restart_count, manifest.restart_count, self.folder)
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

    def started(self, step: int, *, enforced: bool = False) -> None:
        """Say where this start began, with the job's opt-in and its memory cap (`enforced`: torch applied it)."""
        fraction = self.memory_fraction
        note = self.memory_note if fraction is None or fraction >= 1.0 or enforced else (
            f"{self.memory_note}; not enforced: this process has no CUDA device (or does not use torch)")
        log.info("fleetlens under Slurm: job %s, movable %s, memory cap %s (%s)", self.job_id, self.movable,
                 fraction, note)
        write_mark(self.folder, STARTED, Started(job_id=self.job_id, restart_count=self.restart_count, step=step,
                                                 gpus=self.gpus, started_at=time.time(),
                                                 restored_sha256=self.restored_sha256, movable=self.movable,
                                                 memory_fraction=fraction, memory_note=note,
                                                 batch_step=self.batch_step))

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
