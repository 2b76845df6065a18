"""Per-workflow paths under FLEETLENS_HOME: trace folders, checkpoint folders and job logs.

The job SDK, the agent and `fleetlens run` all name the same folders, so the naming lives here once.
"""

from __future__ import annotations

import re
from pathlib import Path

from store.settings import Settings


def path_component(name: str) -> str:
    """A workflow id as one safe path component (ids may hold slashes and spaces: command lines, pod paths)."""
    return re.sub(r"[^A-Za-z0-9._=-]+", "_", name).strip("._")[:120] or "workflow"


def trace_dir_for(trace_root: str | Path, workflow_id: str, request_id: int) -> Path:
    """Where one profile request's traces go: a folder per request, a file per rank (the layout HTA reads)."""
    return Path(trace_root) / path_component(workflow_id) / f"request-{request_id}"


def checkpoint_dir_for(settings: Settings, workflow_id: str) -> Path:
    """The job's checkpoint folder: FLEETLENS_HOME/checkpoints/<workflow> (what collector.examples.train uses)."""
    return settings.checkpoint_dir / path_component(workflow_id)


def log_path_for(settings: Settings, workflow_id: str) -> Path:
    """The output log of a managed job the agent started: FLEETLENS_HOME/logs/<workflow>.log."""
    return settings.home / "logs" / f"{path_component(workflow_id)}.log"
