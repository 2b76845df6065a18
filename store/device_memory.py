"""Memory on devices as the latest samples show it: what processes outside the placements use (managed or not, so
admission never hands it out), and how long a workflow's own per-process memory has been watched."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Mapping

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from store.models import Device, DeviceSample, ProcessSample, Workflow

MEM_STEPS_LABEL = "mem_steps"  # workflows.labels: steps the job SDK has reported its memory for
# workflows.labels: C, bytes one process of the job holds outside PyTorch's caching allocator (CUDA context, library
# workspaces), as the agent measured it: NVML's per-process used memory less torch.cuda.memory_reserved()
CONTEXT_LABEL = "mem_context"
# workflows.labels: one key per host the job SDK's memory was measured on, "mem_host:<host>", whose value is
# [P, E, source, steps, C] as that host's agent measured them (None where it has none). The row's P, E and the two
# labels above are taken over every host's entry (collector.sdk_memory.record_workflow_memory), so a job whose
# ranks run on several hosts is sized by the largest rank, not by the agent that wrote last.
HOST_MEMORY_PREFIX = "mem_host:"


def unplaced_memory(session: Session, device_ids: Collection[int], placed: Mapping[int, Collection[str]],
                    explained: Mapping[int, int]) -> dict[int, int]:
    """Per device, the bytes in use that no placement on it accounts for, from the latest samples.

    Two views, the larger wins: the latest process samples of workflows not placed on the device (a managed job
    placed elsewhere counts too), and the latest device sample's memory used beyond what the placements there
    were admitted with (`explained`, bytes), which also catches processes the per-process list does not show.
    On `cpu` devices only the second: a process is listed there because it ran on the device's cores, not
    because it holds the device's memory."""
    ids = list(device_ids)
    if not ids:
        return {}
    latest_device = (select(DeviceSample.device_id, func.max(DeviceSample.ts).label("ts"))
                     .where(DeviceSample.device_id.in_(ids)).group_by(DeviceSample.device_id).subquery())
    used = dict(session.execute(
        select(DeviceSample.device_id, DeviceSample.mem_used)
        .join(latest_device, (latest_device.c.device_id == DeviceSample.device_id)
              & (latest_device.c.ts == DeviceSample.ts))).all())
    per_process = list(session.scalars(select(Device.id).where(Device.id.in_(ids), Device.source != "cpu")))
    latest_process = (select(ProcessSample.device_id, func.max(ProcessSample.ts).label("ts"))
                      .where(ProcessSample.device_id.in_(per_process)).group_by(ProcessSample.device_id).subquery())
    by_process: dict[int, int] = defaultdict(int)
    for device_id, workflow_id, mem in session.execute(
            select(ProcessSample.device_id, ProcessSample.workflow_id, ProcessSample.mem_used)
            .join(latest_process, (latest_process.c.device_id == ProcessSample.device_id)
                  & (latest_process.c.ts == ProcessSample.ts))):
        if mem and workflow_id not in placed.get(device_id, ()):
            by_process[device_id] += int(mem)
    out = {}
    for device_id in ids:
        beyond = max(0, int(used.get(device_id) or 0) - int(explained.get(device_id, 0)))
        out[device_id] = max(beyond, by_process.get(device_id, 0))
    return out


def process_memory_seen(session: Session, workflow_ids: Collection[str]) -> dict[str, tuple[int, int]]:
    """Per workflow: (how many process samples carried its memory, the largest memory one process showed)."""
    ids = list(workflow_ids)
    if not ids:
        return {}
    rows = session.execute(
        select(ProcessSample.workflow_id, func.count(), func.max(ProcessSample.mem_used))
        .where(ProcessSample.workflow_id.in_(ids), ProcessSample.mem_used.is_not(None))
        .group_by(ProcessSample.workflow_id)).all()
    return {wf: (int(n), int(peak or 0)) for wf, n, peak in rows}


def known_memory(session: Session, workflow: Workflow, min_steps: int) -> tuple[int, int] | None:
    """(P, E) of a workflow if its memory is known well enough to share a device, else None.

    Declared memory (`fleetlens run --mem-mb`, or written by an importer) is taken as given. Memory the job SDK
    measured counts once it was seen for `min_steps` steps; without it, NVML's per-process memory once it was
    seen in `min_steps` samples (its largest process's use is taken as persistent, with no ephemeral peak).

    This is admission's rule (FLEETLENS_MEMORY_SEEN_STEPS, for `fleetlens run` and the planner), on purpose not
    consolidation's minimum history: enforcer.consolidation_sizing's docstring says why the two stay apart."""
    labels = workflow.labels or {}
    if workflow.mem_persistent is not None:
        if labels.get("mem_source") not in ("cuda", "rss"):
            return int(workflow.mem_persistent), int(workflow.mem_ephemeral or 0)
        if int(labels.get(MEM_STEPS_LABEL) or 0) >= min_steps:
            return int(workflow.mem_persistent), int(workflow.mem_ephemeral or 0)
    seen = process_memory_seen(session, [workflow.id]).get(workflow.id)
    if seen is not None and seen[0] >= min_steps and seen[1] > 0:
        return seen[1], 0
    return None


def known_context(workflow: Workflow | None) -> int | None:
    """C to charge a process of the workflow beside its lane, for the memory `known_memory` gives it.

    The agent's measurement when there is one; 0 when the job's memory is host memory (`rss`: no GPU context) or
    came from NVML's per-process figures (no SDK profile, nothing declared: NVML counts the context in them); None
    (unknown: the caller charges Settings.context_mb) for declared memory and SDK allocator figures not yet paired
    with an NVML reading. A job whose SDK profile is too young, sized meanwhile by NVML, is charged the default on
    top: too much by at most that, never too little."""
    if workflow is None:
        return None
    labels = workflow.labels or {}
    measured = labels.get(CONTEXT_LABEL)
    if isinstance(measured, int) and not isinstance(measured, bool) and measured >= 0:
        return measured
    if labels.get("mem_source") == "rss":
        return 0
    if workflow.mem_persistent is None:
        return 0
    return None
