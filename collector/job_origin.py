"""Where a job starts from: its workflow id when it names none (the environment's, else the agent's attribution),
and the step it resumes at."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

from collector import attribution
from store.errors import ConfigError
from store.settings import Settings

log = logging.getLogger(__name__)


def default_workflow_id(settings: Settings) -> tuple[str, str]:
    """(workflow id, how it was found): FLEETLENS_WORKFLOW, else what the agent's attribution says of this
    process (Slurm job, Kubernetes pod, command line), so step times and device samples meet in one workflow."""
    if settings.workflow:
        return settings.workflow, "env"
    try:
        result = attribution.attribute(os.getpid())
        if isinstance(result, tuple):
            return str(result[0]), str(result[1])
        if result is not None:
            return str(result.workflow_id), str(getattr(result, "id_source", "cmdline"))
    except Exception:  # attribution is best effort here; the command line below is always there
        log.debug("attribution of this process failed", exc_info=True)
    return " ".join(sys.orig_argv) or sys.executable, "cmdline"


def start_step(resume_from: Path | None, restore: Callable[[str], int | None] | None, resume_step: int | None) -> int:
    """The step a job starts at: what `restore` says of the checkpoint `resume_from` (FLEETLENS_RESUME_FROM), else
    `resume_step` (FLEETLENS_RESUME_STEP), else 0."""
    if resume_from is not None:
        if not resume_from.exists():
            raise ConfigError(
                f"FLEETLENS_RESUME_FROM names {resume_from}, which does not exist; "
                "point it at a checkpoint the job saved, or unset it to start from step 0"
            )
        step = restore(str(resume_from)) if restore is not None else None
        if step is None:
            step = resume_step
        return int(step or 0)
    if resume_step is not None:
        return resume_step
    return 0
