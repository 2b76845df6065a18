"""The checkpoint requests the enforcer makes of running jobs through an agent's SDK handlers (collector.sdk_handlers):
which job was told about each, and what its ranks answered. Held in memory only: a checkpoint is only ever wanted
from a job that runs now.

Not thread-safe: the handlers call every method under their lock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class _Checkpoint:
    workflow_id: str
    request_id: Any
    directory: str
    requested_at: float
    delivered: set[tuple[int, int]] = field(default_factory=set)  # (pid, rank) told about it
    answers: dict[int, dict[str, Any]] = field(default_factory=dict)  # rank -> its answer


class CheckpointRequests:
    """The open checkpoint requests, by request id."""

    def __init__(self) -> None:
        self._checkpoints: dict[str, _Checkpoint] = {}

    def request(self, workflow_id: str, request_id: Any, directory: str | Path) -> None:
        key = str(request_id)
        if key not in self._checkpoints:  # asking twice is asking once
            self._checkpoints[key] = _Checkpoint(workflow_id, request_id, str(directory), time.time())

    def result(self, request_id: Any) -> dict[str, Any] | None:
        """The job's answer, or None while there is none yet (or for an unknown request); see
        SdkHandlers.checkpoint_result."""
        ckpt = self._checkpoints.get(str(request_id))
        if ckpt is None or not ckpt.answers:
            return None
        ranks_told = {rank for _pid, rank in ckpt.delivered}
        if 0 in ckpt.answers:
            main = ckpt.answers[0]
        elif ranks_told and ranks_told <= set(ckpt.answers):
            main = ckpt.answers[min(ckpt.answers)]
        else:
            return None
        failed = [a for a in ckpt.answers.values() if a["status"] == "failed"]
        return {
            "request_id": ckpt.request_id, "workflow_id": ckpt.workflow_id,
            "status": "failed" if failed else "done", "path": main.get("path"), "step": main.get("step"),
            "error": failed[0]["error"] if failed else None,
            "ranks": {rank: dict(answer) for rank, answer in ckpt.answers.items()},
        }

    def delivered(self, request_id: Any) -> bool:
        ckpt = self._checkpoints.get(str(request_id))
        return bool(ckpt and ckpt.delivered)

    def cancel(self, request_id: Any) -> None:
        self._checkpoints.pop(str(request_id), None)

    def answer(self, request_id: Any, rank: Any, answer: dict[str, Any]) -> bool:
        """Keep the answer of a rank (as the message gives it); False when no such request waits (cancelled, say)."""
        ckpt = self._checkpoints.get(str(request_id))
        if ckpt is None:
            return False
        answer.setdefault("error", None)
        ckpt.answers[int(rank or 0)] = answer
        return True

    def deliver(self, workflow_id: str, who: tuple[int, int]) -> dict[str, Any] | None:
        """The request to tell the process `who` (pid, rank) of the workflow about, if one waits for it (it is told
        once)."""
        for ckpt in self._checkpoints.values():
            if ckpt.workflow_id == workflow_id and who not in ckpt.delivered and who[1] not in ckpt.answers:
                ckpt.delivered.add(who)
                return {"request_id": ckpt.request_id, "directory": ckpt.directory}
        return None
