"""The agent's record of job memory: each process's (P, E) from its step summaries, a workflow's from them."""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from store.device_memory import CONTEXT_LABEL, MEM_STEPS_LABEL
from store.models import Workflow
from store.rows import merge_labels

# (workflow, pid) -> P, E, source, and how many steps the memory was seen for
ProcessMemory = dict[tuple[str, int], tuple[int | None, int | None, str, int]]


def note_memory(mem: ProcessMemory, key: tuple[str, int], batches: list[dict[str, Any]]) -> bool:
    """Keep each process's (P, E) at the largest it has shown, and the steps it was seen for; True when that
    changed. Call under the lock."""
    before = mem.get(key)
    persistent, ephemeral, source, steps = before or (None, None, "", 0)
    for b in batches:
        src, mp, peak = b.get("mem_source"), as_int(b.get("mem_persistent")), as_int(b.get("mem_peak"))
        if src not in ("cuda", "rss") or mp is None or (source == "cuda" and src != "cuda"):
            continue
        if src != source:  # CUDA numbers replace host-memory ones
            persistent, ephemeral, source, steps = None, None, src, 0
        persistent = max(persistent or 0, mp)
        if peak is not None:
            ephemeral = max(ephemeral or 0, peak - mp)
        steps += max(1, as_int(b.get("n_steps")) or 1)
    if not source:
        return False
    mem[key] = (persistent, ephemeral, source, steps)
    return mem[key] != before


def workflow_memory(mem: ProcessMemory, wf: str) -> tuple[int | None, int | None, str | None, int]:
    """The workflow's P and E: the largest over its processes, CUDA numbers preferred; and the most steps any
    of its processes was seen for. Call under the lock."""
    mine = [v for k, v in mem.items() if k[0] == wf]
    if not mine:
        return None, None, None, 0
    best = "cuda" if any(v[2] == "cuda" for v in mine) else "rss"
    values = [v for v in mine if v[2] == best]
    return (max((v[0] for v in values if v[0] is not None), default=None),
            max((v[1] for v in values if v[1] is not None), default=None), best, max(v[3] for v in values))


def record_workflow_memory(session: Session, wf: str,
                           figures: tuple[int | None, int | None, str | None, int]) -> None:
    """Put a workflow's P and E (`workflow_memory`) on its row, with where they come from and the steps seen."""
    persistent, ephemeral, source, steps = figures
    workflow = session.get(Workflow, wf)
    if workflow is None or source is None:
        return
    workflow.mem_persistent, workflow.mem_ephemeral = persistent, ephemeral
    labels = workflow.labels or {}
    if labels.get("mem_source") == source:  # a restarted job's count starts again: keep the most
        steps = max(steps, int(labels.get(MEM_STEPS_LABEL) or 0))
    if labels.get("mem_source") != source or labels.get(MEM_STEPS_LABEL) != steps:
        merge_labels(session, workflow, {"mem_source": source, MEM_STEPS_LABEL: steps})


def record_workflow_context(session: Session, wf: str, context: int | None) -> None:
    """Put a workflow's measured C (collector.sdk_context) on its row (labels, store.device_memory.CONTEXT_LABEL),
    where admission and the fleet state read it (store.device_memory.known_context)."""
    if context is None:
        return
    workflow = session.get(Workflow, wf)
    if workflow is None:
        return
    labels = workflow.labels or {}
    if labels.get(CONTEXT_LABEL) != int(context):
        merge_labels(session, workflow, {CONTEXT_LABEL: int(context)})


def as_int(value: Any) -> int | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None
