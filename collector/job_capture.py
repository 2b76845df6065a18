"""On-demand profiling inside a job: torch.profiler over the next N steps, written as gzipped Kineto JSON."""

from __future__ import annotations

import gzip
import json
import logging
import os
import socket
import sys
import threading
from pathlib import Path
from typing import Any, Protocol

from store.errors import ConfigError
from store.paths import path_component, trace_dir_for

log = logging.getLogger(__name__)


class CaptureOwner(Protocol):
    """What a capture needs of the job it traces (collector.job.Job)."""

    rank: int
    pid: int
    workflow_id: str
    _capture_threads: list[threading.Thread]

    @property
    def step(self) -> int: ...

    def _capture_finished(self, result: dict[str, Any]) -> None: ...


def trace_folder(trace_dir: Path, workflow_id: str, suggested: str | None, request_id: int) -> Path:
    """The agent's folder for the request if this job can write there, else the job's own FLEETLENS_HOME."""
    candidates = [Path(suggested)] if suggested else []
    candidates.append(trace_dir_for(trace_dir, workflow_id, request_id))
    for folder in candidates:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            if os.access(folder, os.W_OK):
                return folder
        except OSError:
            continue
    raise ConfigError(f"no trace folder can be written: {', '.join(map(str, candidates))}")


class TraceCapture:
    """One on-demand trace: torch.profiler over the next N steps, then gzipped Kineto JSON with the rank set."""

    def __init__(self, owner: CaptureOwner, request_id: int, steps: int, folder: Path) -> None:
        import torch
        from torch.profiler import ProfilerAction, ProfilerActivity, profile

        self.owner, self.request_id, self.steps, self.folder = owner, request_id, steps, folder
        self.first_step = owner.step
        self.recorded = 0
        self.done = False
        self._ready_called = False
        self._actions = ProfilerAction
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        # a schedule makes torch mark each step (ProfilerStep#k), which HTA needs to find iterations
        self.profiler = profile(activities=activities, schedule=self._schedule, on_trace_ready=self._ready)
        self.profiler.start()

    def _schedule(self, step: int) -> Any:
        if step < self.steps - 1:
            return self._actions.RECORD
        return self._actions.RECORD_AND_SAVE if step == self.steps - 1 else self._actions.NONE

    def step(self) -> None:
        self.recorded += 1
        self.profiler.step()
        self.done = self._ready_called or self.recorded >= self.steps

    def finish(self) -> None:
        """Stop the profiler (saving what it has, if the job ends early)."""
        try:
            self.profiler.stop()
        except Exception as exc:
            log.debug("profiler stop failed", exc_info=True)
            if not self._ready_called:
                self._result(error=f"the profiler failed to stop: {exc}")
                return
        if not self._ready_called:
            self._result(error="the job ended before any step was captured")

    def _ready(self, prof: Any) -> None:
        self._ready_called = True
        if self.recorded == 0:
            self._result(error="the job ended before any step was captured")
            return
        owner = self.owner
        stem = f"rank{owner.rank}.{path_component(socket.gethostname())}.{owner.pid}"
        raw = self.folder / f".{stem}.raw"  # names HTA does not read (it reads *.json and *.gz)
        try:
            prof.export_chrome_trace(str(raw))
        except Exception as exc:
            self._result(error=f"exporting the trace failed: {exc}")
            return
        thread = threading.Thread(target=self._write, args=(raw, self.folder / f"{stem}.pt.trace.json.gz"),
                                  name="fleetlens-trace-writer", daemon=True)
        owner._capture_threads.append(thread)
        thread.start()

    def _write(self, raw: Path, final: Path) -> None:
        """Rank into distributedInfo (first, where HTA looks for it), gzip, rename into place."""
        partial = final.with_name(final.name + ".partial")
        try:
            with open(raw, encoding="utf-8") as f:
                data = json.load(f)
            info = {k: v for k, v in (data.get("distributedInfo") or {}).items() if k != "rank"}
            world, backend = distributed_world()
            info.setdefault("world_size", world)
            info.setdefault("backend", backend)
            data.pop("distributedInfo", None)
            trace = {"distributedInfo": {"rank": self.owner.rank, **info}, **data, "fleetlens": {
                "workflow": self.owner.workflow_id, "request_id": self.request_id, "first_step": self.first_step,
                "steps": self.recorded, "pid": self.owner.pid,
            }}
            with gzip.open(partial, "wt", encoding="utf-8", compresslevel=6) as f:
                json.dump(trace, f)
            os.replace(partial, final)
            self._result(path=str(final), size_bytes=final.stat().st_size)
        except Exception as exc:
            partial.unlink(missing_ok=True)
            self._result(error=f"writing the trace failed: {type(exc).__name__}: {exc}")
        finally:
            raw.unlink(missing_ok=True)

    def _result(self, *, path: str | None = None, size_bytes: int | None = None, error: str | None = None) -> None:
        result: dict[str, Any] = {"request_id": self.request_id}
        if path is not None:
            result.update(path=path, size_bytes=size_bytes, steps=self.recorded, first_step=self.first_step)
        else:
            result["error"] = error
        self.owner._capture_finished(result)


def distributed_world() -> tuple[int, str]:
    """(world size, backend) of torch.distributed when it runs, else a single process."""
    dist = getattr(sys.modules.get("torch"), "distributed", None)
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return dist.get_world_size(), str(dist.get_backend())
    except Exception:
        pass
    return 1, "none"
