"""Checkpoints as facts in the store: where a job's checkpoints live (a URL read through fsspec), what each one
the agent saw written holds (step, size, sha256), and which hosts say they can read (and write) which locations.

A workflow's checkpoint location is `<checkpoint url>/<workflow>` when the fleet (FLEETLENS_CHECKPOINT_URL) or
the job (`fleetlens run --checkpoint-url`) names one: a local or shared folder, or an object store whose fsspec
backend is installed. Without one, the job checkpoints into its host's FLEETLENS_HOME, which no other host is
assumed to read: such a job can move between the devices of its host only.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import fsspec
from fsspec.utils import get_protocol
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from store.errors import InvalidInput
from store.models import Checkpoint, HostStorage, Workflow
from store.paths import path_component

LOCAL_PROTOCOLS = ("file", "local")
WRITE_FAILURE = "cannot be written here"  # how a probe that could read a location but not write it says so
_CHUNK = 1 << 20


def is_local(url: str) -> bool:
    """Whether `url` names a path of this machine's filesystem (a local or mounted shared folder)."""
    return get_protocol(url) in LOCAL_PROTOCOLS


def local_path(url: str) -> Path:
    """The filesystem path of a local URL (`/x`, `file:///x`)."""
    _, path = fsspec.core.url_to_fs(url)
    return Path(path)


def location_for(checkpoint_url: str, workflow_id: str) -> str:
    """The workflow's checkpoint location under a fleet's or job's checkpoint URL."""
    base = checkpoint_url.rstrip("/")
    if is_local(base):
        return str(local_path(base) / path_component(workflow_id))
    return f"{base}/{path_component(workflow_id)}"


def check_location(url: str) -> None:
    """Raise InvalidInput unless the location can be created and written here (before a job relies on it)."""
    try:
        fs, path = fsspec.core.url_to_fs(url)
        fs.makedirs(path, exist_ok=True)
        probe = f"{path.rstrip('/')}/.fleetlens-probe"
        fs.pipe_file(probe, b"")
        fs.rm_file(probe)
    except ImportError as exc:
        raise InvalidInput(f"the checkpoint location {url} needs an fsspec backend that is not installed ({exc}); "
                           "install it, or choose a local or shared folder") from None
    except (OSError, ValueError) as exc:
        raise InvalidInput(f"the checkpoint location {url} cannot be written ({exc}); choose a folder or bucket "
                           "this host can write, with --checkpoint-url or FLEETLENS_CHECKPOINT_URL") from None


def digest(url: str) -> tuple[str, int]:
    """(sha256 hex, size in bytes) of the file at `url`, read through fsspec."""
    h = hashlib.sha256()
    size = 0
    with fsspec.open(url, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def probe(url: str, *, write_as: str | None = None) -> str | None:
    """None when this host can list the location `url` and, given `write_as` (the host's name), write a small file
    there, read it back and delete it; else why not. A job moved to a host that can read its checkpoints but not
    write them would resume there and then fail at its next checkpoint, so a target must be able to do both."""
    try:
        fs, path = fsspec.core.url_to_fs(url)
        if not fs.isdir(path):
            return f"{url} is not a folder this host can see"
        fs.ls(path, detail=False)
    except ImportError as exc:
        return f"no fsspec backend for {url} on this host ({exc})"
    except (OSError, ValueError) as exc:
        return f"{url} cannot be read here: {exc}"
    return None if write_as is None else _write_probe(fs, path, url, write_as)


def _write_probe(fs: fsspec.AbstractFileSystem, path: str, url: str, host: str) -> str | None:
    """Write, read back and delete `.fleetlens-probe-<host>` in the folder (a dot file: a job's own listing of its
    checkpoints skips it, and each host writes its own, so probes of several hosts never meet)."""
    target = f"{path.rstrip('/')}/.fleetlens-probe-{path_component(host)}"
    payload = f"{host} {time.time()!r}".encode()
    try:
        fs.pipe_file(target, payload)
        try:
            if fs.cat_file(target) != payload:
                return f"{url} {WRITE_FAILURE}: it did not give back what this host wrote to it"
        finally:
            fs.rm_file(target)
    except (OSError, ValueError) as exc:
        return f"{url} {WRITE_FAILURE}: {exc}"
    return None


@dataclass(frozen=True)
class CheckpointFact:
    id: int
    workflow_id: str
    step: int | None
    size_bytes: int
    url: str
    sha256: str
    host_id: str


def record_checkpoint(session: Session, workflow_id: str, *, host_id: str, url: str, step: int | None,
                      sha256: str, size_bytes: int, action_id: int | None = None,
                      now: float | None = None) -> CheckpointFact:
    row = Checkpoint(workflow_id=workflow_id, host_id=host_id, url=url, step=step, sha256=sha256,
                     size_bytes=int(size_bytes), action_id=action_id, created_at=time.time() if now is None else now)
    session.add(row)
    session.flush()
    return _fact(row)


def get_checkpoint(session: Session, checkpoint_id: int) -> CheckpointFact | None:
    row = session.get(Checkpoint, checkpoint_id)
    return None if row is None else _fact(row)


def latest_checkpoint(session: Session, workflow_id: str) -> CheckpointFact | None:
    row = session.scalar(select(Checkpoint).where(Checkpoint.workflow_id == workflow_id)
                         .order_by(Checkpoint.created_at.desc(), Checkpoint.id.desc()).limit(1))
    return None if row is None else _fact(row)


def latest_checkpoint_times(session: Session, now: float) -> dict[str, float]:
    """Each workflow's latest checkpoint time at or before `now`; workflows that recorded none are left out."""
    return {wf: float(ts) for wf, ts in session.execute(
        select(Checkpoint.workflow_id, func.max(Checkpoint.created_at))
        .where(Checkpoint.created_at <= now).group_by(Checkpoint.workflow_id)).all()}


def _fact(row: Checkpoint) -> CheckpointFact:
    return CheckpointFact(row.id, row.workflow_id, row.step, int(row.size_bytes), row.url, row.sha256, row.host_id)


# ---- which hosts can read which locations ------------------------------------------------------------------

def locations_to_probe(session: Session, fleet_url: str | None) -> list[str]:
    """The checkpoint locations an agent should say it can read and write: the fleet's root, which stands for every
    job's folder under it (so a round costs one listing and one small write per host, however many jobs run), and
    the location of each managed job, running or being moved, that lies elsewhere (its own --checkpoint-url)."""
    root = fleet_url.rstrip("/") if fleet_url else None
    urls = set(session.scalars(select(Workflow.checkpoint_url).where(
        Workflow.managed.is_(True), Workflow.checkpoint_url.is_not(None),
        Workflow.state.in_(("running", "moving")))))
    if root:
        urls = {u for u in urls if not u.startswith(root + "/")} | {root}
    return sorted(u for u in urls if u)


def probed_for(url: str) -> list[str]:
    """The locations whose probe speaks for `url`, nearest first: itself, then each folder above it (a probe of the
    fleet's root speaks for the jobs' folders under it)."""
    found = [url]
    while "/" in url.rstrip("/"):
        url = url.rstrip("/").rpartition("/")[0]
        if url and not url.rstrip("/").endswith(":"):  # not a bare scheme ("s3://")
            found.append(url)
    return found


def record_probes(session: Session, host_id: str, results: Iterable[tuple[str, str | None]], *,
                  now: float | None = None) -> None:
    """Write this host's probe results: (url, None when it can read it, and write it where the probe tried, else the
    reason); `readable` says whether the host may take a job whose checkpoints live there."""
    now = time.time() if now is None else now
    for url, error in results:
        row = session.get(HostStorage, (host_id, url))
        if row is None:
            row = HostStorage(host_id=host_id, url=url)
            session.add(row)
        row.readable, row.error, row.checked_at = error is None, error, now
    session.flush()


def readable_hosts_by_workflow(session: Session, workflows: Iterable[Workflow], *, max_age_s: float,
                               now: float | None = None) -> dict[str, frozenset[str]]:
    """{workflow id: the hosts that said, within `max_age_s`, that they can read and write its checkpoint location}
    (one query, the same test as `unreadable_reason` for every job at once): where a planner may move it besides
    its own host. For each host, the nearest probe of the location or of a folder above it decides. A job
    checkpointing into its host's own FLEETLENS_HOME (no location) gets no host: it moves within its host only. The
    planner and consolidation both take these facts as data."""
    now = time.time() if now is None else now
    said: dict[str, dict[str, bool]] = {}  # url -> {host: usable}
    for host_id, url, readable in session.execute(select(HostStorage.host_id, HostStorage.url, HostStorage.readable)
                                                  .where(HostStorage.checked_at >= now - max_age_s)):
        said.setdefault(url, {})[host_id] = bool(readable)
    out: dict[str, frozenset[str]] = {}
    for wf in workflows:
        decided: dict[str, bool] = {}
        for url in probed_for(wf.checkpoint_url) if wf.checkpoint_url else ():
            for host, usable in said.get(url, {}).items():
                decided.setdefault(host, usable)
        out[wf.id] = frozenset(host for host, usable in decided.items() if usable)
    return out


def unreadable_reason(session: Session, workflow: Workflow, source_host: str | None, target_host: str, *,
                      max_age_s: float, now: float | None = None) -> str | None:
    """Why `target_host` cannot be trusted to read `workflow`'s checkpoints (None when it can)."""
    if target_host == source_host:
        return None
    if not workflow.checkpoint_url:
        return (f"{workflow.id} checkpoints into {source_host}'s own FLEETLENS_HOME, which host {target_host} cannot "
                "read; give the fleet shared or object storage (FLEETLENS_CHECKPOINT_URL or --checkpoint-url) to "
                "move it between hosts")
    now = time.time() if now is None else now
    nearest = probed_for(workflow.checkpoint_url)
    rows = {r.url: r for r in session.scalars(select(HostStorage).where(
        HostStorage.host_id == target_host, HostStorage.url.in_(nearest),
        HostStorage.checked_at >= now - max_age_s))}
    row = next((rows[url] for url in nearest if url in rows), None)
    if row is None:  # none recent: the newest, to say how old it is
        row = session.scalars(select(HostStorage).where(HostStorage.host_id == target_host,
                                                        HostStorage.url.in_(nearest))
                              .order_by(HostStorage.checked_at.desc()).limit(1)).first()
    if row is None:
        return f"host {target_host} has not said whether it can read {workflow.checkpoint_url} (is its agent running?)"
    if not row.readable:
        verb = "write" if WRITE_FAILURE in (row.error or "") else "read"
        return f"host {target_host} cannot {verb} {workflow.checkpoint_url}: {row.error}"
    if now - row.checked_at > max_age_s:
        return (f"host {target_host} last said it can read {workflow.checkpoint_url} {now - row.checked_at:.0f} s ago "
                f"(more than {max_age_s:.0f} s: is its agent running?)")
    return None
