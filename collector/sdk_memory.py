"""The agent's record of job memory: each process's (P, E) from its step summaries, a workflow's from them, and the
workflow's row from every host's record."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from store.device_memory import CONTEXT_LABEL, HOST_MEMORY_PREFIX, MEM_STEPS_LABEL
from store.models import Workflow
from store.rows import merge_labels

# (workflow, pid) -> P, E, source, and how many steps the memory was seen for
ProcessMemory = dict[tuple[str, int], tuple[int | None, int | None, str, int]]
# the pid under which a workflow's processes that ended are kept, folded into one entry: pid 0 is no job's process
ENDED_PID = 0


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


def fold_ended(mem: ProcessMemory, key: tuple[str, int]) -> None:
    """Fold the figures of a process that ended into its workflow's entry of ended processes (ENDED_PID), so that the
    workflow's figures still count it and no entry per process stays. Call under the lock."""
    if key[1] == ENDED_PID or key not in mem:
        return
    figures = mem.pop(key)
    ended = (key[0], ENDED_PID)
    kept = mem.get(ended)
    if kept is None:
        mem[ended] = figures
        return
    persistent, ephemeral, source, steps = largest([kept, figures])
    mem[ended] = (persistent, ephemeral, source or figures[2], steps)


def forget_workflow(mem: ProcessMemory, wf: str) -> None:
    """Drop every entry of a workflow none of whose processes runs here any more. Call under the lock."""
    for key in [k for k in mem if k[0] == wf]:
        del mem[key]


def workflow_memory(mem: ProcessMemory, wf: str) -> tuple[int | None, int | None, str | None, int]:
    """The workflow's P and E: the largest over its processes, CUDA numbers preferred; and the most steps any
    of its processes was seen for. Call under the lock."""
    return largest([v for k, v in mem.items() if k[0] == wf])


def largest(figures: list[tuple[int | None, int | None, str, int]]) -> tuple[int | None, int | None, str | None, int]:
    """(P, E, source, steps) over several processes' or hosts' figures: CUDA numbers preferred, then the largest P,
    the largest E and the most steps among those of that source; (None, None, None, 0) for none."""
    if not figures:
        return None, None, None, 0
    best = "cuda" if any(v[2] == "cuda" for v in figures) else "rss"
    values = [v for v in figures if v[2] == best]
    return (max((v[0] for v in values if v[0] is not None), default=None),
            max((v[1] for v in values if v[1] is not None), default=None), best, max(v[3] for v in values))


def record_workflow_memory(session: Session, wf: str, host_id: str,
                           figures: tuple[int | None, int | None, str | None, int], context: int | None) -> None:
    """Put what this host measured of a workflow (`workflow_memory`'s P, E, source and steps, and its C from
    collector.sdk_context) in its host entry (store.device_memory.HOST_MEMORY_PREFIX), then set the row's P and E,
    `mem_source`, `mem_steps` and `mem_context` from every host's entry: CUDA figures preferred, the largest of each.

    Agents on several hosts write the same workflow. The row is locked first (PostgreSQL; on SQLite the entry's
    UPDATE takes the write lock), each host's entry is merged in SQL (store.rows.merge_labels), and the entries are
    read back after the merge, so the figures taken include every host's as committed, and no agent's write
    replaces another's with its own alone."""
    persistent, ephemeral, source, steps = figures
    if source is None and context is None:
        return
    workflow = session.execute(select(Workflow).filter_by(id=wf).with_for_update()
                               .execution_options(populate_existing=True)).scalar_one_or_none()
    if workflow is None:
        return
    key = HOST_MEMORY_PREFIX + host_id
    old = _host_entry((workflow.labels or {}).get(key))
    if source is None and old is not None:  # a context alone: this host's memory figures stay as they were
        persistent, ephemeral, source, steps = old[:4]
    if old is not None and old[2] == source:  # a restarted job's count starts again: keep the most
        steps = max(steps, old[3])
    if context is None and old is not None:
        context = old[4]
    entry = [persistent, ephemeral, source, steps, None if context is None else int(context)]
    # written even when unchanged: on SQLite the UPDATE is what takes the write lock, so the entries read back
    # next are every host's as committed, and no other agent writes before this transaction ends
    merge_labels(session, workflow, {key: entry})
    labels = workflow.labels or {}  # read back after the merge: every host's entry as committed
    entries = [e for k, v in labels.items() if k.startswith(HOST_MEMORY_PREFIX) and (e := _host_entry(v))]
    patch: dict[str, Any] = {}
    persistent, ephemeral, best, most = largest([e[:4] for e in entries if e[2] in ("cuda", "rss")])
    if best is not None:
        if labels.get("mem_source") == best:  # a row written before the host entries keeps its count
            most = max(most, int(labels.get(MEM_STEPS_LABEL) or 0))
        workflow.mem_persistent, workflow.mem_ephemeral = persistent, ephemeral
        patch.update({"mem_source": best, MEM_STEPS_LABEL: most})
    contexts = [e[4] for e in entries if e[4] is not None]
    if contexts:
        patch[CONTEXT_LABEL] = max(contexts)
    patch = {k: v for k, v in patch.items() if labels.get(k) != v}
    if patch:
        merge_labels(session, workflow, patch)


def _host_entry(value: Any) -> tuple[int | None, int | None, str | None, int, int | None] | None:
    """A host entry as (P, E, source, steps, C), or None when the value is not one (a hand-edited label)."""
    if not isinstance(value, list) or len(value) != 5:
        return None
    persistent, ephemeral, source, steps, context = value
    if source not in ("cuda", "rss", None):
        return None
    return as_int(persistent), as_int(ephemeral), source, as_int(steps) or 0, as_int(context)


def as_int(value: Any) -> int | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None
