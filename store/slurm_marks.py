"""What a Slurm job's SDK leaves in its checkpoint folder for the Slurm actuator to read: the manifest of its latest
checkpoint (step, size, sha256, written for which signal) and where each start of the job began (its restart count,
its step, the GPUs it was given). Files, not a socket: the enforcer and the job meet only in the shared checkpoint
location, as on a cluster where no fleetlens agent runs on the nodes.

The start mark also says whether the job's SDK asked to be movable (FLEETLENS_MOVABLE, `job(movable=True)`): the
second way a Slurm job opts in beside its --comment (store.slurm.opt_in decides; `sdk_asked_from` reads the marks
for it), the memory cap the SDK computed from its shards, and whether the SDK is the batch step's own process (the
batch script exec'd it), which the actuator needs before it sends the checkpoint signal to the batch step. A mark
written before these fields existed reads as not asked, no cap, and not known to be the batch step's process."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

import fsspec
from sqlalchemy import select

from store.checkpoints import location_for
from store.db import Store
from store.errors import InvalidInput
from store.models_slurm import GONE
from store.models_slurm import SlurmJob as SlurmJobRow
from store.settings import Settings
from store.slurm import SdkAsked, workflow_id_of

log = logging.getLogger(__name__)

CHECKPOINT_MANIFEST = "fleetlens-checkpoint.json"
STARTED = "fleetlens-started.json"
# a start mark counts for a job only if it was written after the job's submission (Slurm's clock and the node's
# may differ by this much): a mark left by an earlier job under a reused id does not opt a new one in
CLOCK_SLACK_S = 60.0


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
    movable: bool = False  # the job's SDK asked to be movable (FLEETLENS_MOVABLE, job(movable=True))
    memory_fraction: float | None = None  # the CUDA memory cap the SDK computed (None: no cap)
    memory_note: str | None = None  # where that cap came from, or why there is none
    # the SDK's process is the batch step's own (its parent is the job's `slurmstepd: [<id>.batch]`: the script
    # exec'd it), so the checkpoint signal sent to the batch step reaches it; None: not known (an older SDK)
    batch_step: bool | None = None


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
    if doc is None:
        return None
    known = {f.name for f in fields(Started)}  # a newer SDK's extra fields are not this reader's business
    try:
        return Started(**{k: v for k, v in doc.items() if k in known})
    except TypeError as exc:
        raise InvalidInput(f"{folder}/{STARTED} is not the start mark the fleetlens SDK writes ({exc})") from None


def asked_to_move(started: Started | None, job_id: int, submit_time: float, restart_count: int, *,
                  first_submit_time: float | None = None) -> bool:
    """Whether a start mark says this job's SDK asked to be movable: its own mark, saying so. Its own: the job id, and
    written after the job was submitted. A requeue gives the job a new submit time, so a mark of an earlier run of
    the job (before a requeue: a lower restart count) is its own only when written after the job's first submission
    (`first_submit_time`, as the store saw it); without that, only a mark written after the job's latest submission
    counts. A mark left by an earlier job under a reused id, written before this job was first submitted, never
    counts, however many times this job was requeued."""
    if started is None or not started.movable or started.job_id != job_id:
        return False
    since = submit_time
    if started.restart_count < restart_count and first_submit_time is not None:
        since = min(first_submit_time, submit_time)
    return started.started_at >= since - CLOCK_SLACK_S


class StartMarks:
    """The start marks of one reading of the cluster, each job's read at most once (one read of the shared checkpoint
    location per job, and one answer for both questions asked of it: did its SDK ask to be movable, may it be
    signalled). A mark that could not be read raises the same error each time it is asked for."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._read: dict[str, Started | None | InvalidInput | OSError] = {}

    def started(self, workflow_id: str) -> Started | None:
        if workflow_id not in self._read:
            try:
                self._read[workflow_id] = read_started(job_folder(self.settings, workflow_id))
            except (InvalidInput, OSError) as exc:
                self._read[workflow_id] = exc
        found = self._read[workflow_id]
        if isinstance(found, (InvalidInput, OSError)):
            raise found
        return found


def sdk_asked_from(settings: Settings, marks: StartMarks | None = None, *,
                   first_submits: Mapping[int, float] | None = None) -> SdkAsked:
    """What store.slurm.parse_jobs consults for a job without the opt-in comment: its start mark, in its checkpoint
    location as the enforcer's host sees it: read through `marks` when given (one reading of the cluster reads each
    mark once), else afresh at each call. `first_submits`: {job id: its first submission the store saw}, which lets a
    mark of the job's run before a requeue count (asked_to_move). A mark that cannot be read counts as not asked
    (logged)."""
    def started_of(workflow_id: str) -> Started | None:
        return marks.started(workflow_id) if marks is not None else read_started(job_folder(settings, workflow_id))

    def asked(job_id: int, submit_time: float, restart_count: int) -> bool:
        try:
            started = started_of(workflow_id_of(job_id))
        except (InvalidInput, OSError) as exc:
            log.warning("slurm job %s: its start mark cannot be read (%s); it counts as not asking to be movable",
                        job_id, exc)
            return False
        return asked_to_move(started, job_id, submit_time, restart_count,
                             first_submit_time=(first_submits or {}).get(job_id))
    return asked


def first_submits(store: Store, job_ids: list[int] | None = None) -> dict[int, float]:
    """{job id: its first submission the store saw} of the jobs (those of `job_ids`, else all) it has not seen end:
    a start mark of an earlier run of the job (before a requeue) counts only when written after it
    (asked_to_move)."""
    query = select(SlurmJobRow.job_id, SlurmJobRow.submit_time).where(SlurmJobRow.state != GONE)
    if job_ids is not None:
        query = query.where(SlurmJobRow.job_id.in_(job_ids))
    with store.session() as session:
        return dict(session.execute(query).tuples().all())


def signal_unsafe(started: Started) -> str | None:
    """Why the checkpoint signal must not be sent to the job whose current start mark is `started` (None: safe): its
    SDK is not the batch step's own process, or its mark, from an SDK older than that check, does not say. Not knowing
    counts as unsafe: a job lost to the signal is worse than a job not moved."""
    if started.batch_step is True:
        return None
    if started.batch_step is False:
        return ("its fleetlens SDK runs as a child of the batch script, not as the batch step's own process (the "
                "script started it without `exec`, or through srun)")
    return ("its start mark does not say whether its fleetlens SDK is the batch step's own process (a mark from an "
            "SDK older than that check)")
