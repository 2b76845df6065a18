"""The analyzer's periodic work as entry points the Airflow DAGs and `fleetlens serve` both call: hourly rollups and
retention, telemetry detection, and analysis of traces not yet analysed. Each returns a small JSON-able summary."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from analyzer.ranking import rank_with_waste
from analyzer.rollups import apply_retention, rollup
from analyzer.serving.rules import detect_serving
from analyzer.slurm_holders import find_slurm_holders_without_processes
from analyzer.telemetry import detect
from analyzer.traces import analyze_batch, analyze_pending, pending_batches
from analyzer.traces.cache import TraceBounds
from analyzer.traces.claims import ClaimPolicy
from store.db import Store
from store.partitions import adopt_early_rows, ensure_partitions
from store.settings import Settings


def rollup_hours(store: Store, settings: Settings, *, now: float | None = None) -> dict[str, Any]:
    """Roll up every closed hour not rolled up yet, and again every hour of the retention's days that samples reached
    after it was rolled up (an agent's spool, an import of the past)."""
    # the coming days' sample partitions exist before their first rows arrive, and rows that came early (an
    # agent's clock ahead) move into their day's partition (PostgreSQL; nothing on SQLite)
    created = ensure_partitions(store, now, now) + adopt_early_rows(store)
    # the look-back is the retention's: it deletes no sample younger, so every hour in it is whole to roll up again
    result = rollup(store, now, recheck_days=settings.retention_days)
    return {"hours": result.hours, "device_rows": result.device_rows, "workflow_rows": result.workflow_rows,
            "first_hour": result.first_hour, "last_hour": result.last_hour,
            "rerolled_hours": list(result.rerolled_hours), "partitions_created": created}


def retain(store: Store, settings: Settings, *, now: float | None = None) -> dict[str, Any]:
    """Drop raw samples older than `settings.retention_days`, of hours already rolled up (or that samples reached too
    late for any rollup: `late_samples_deleted`)."""
    result = apply_retention(store, settings.retention_days, now)
    return {"cutoff": result.cutoff, "device_samples_deleted": result.device_samples_deleted,
            "process_samples_deleted": result.process_samples_deleted, "hours_kept": result.hours_kept,
            "late_samples_deleted": result.late_samples_deleted, "partitions_dropped": list(result.partitions_dropped)}


def rollup_and_retain(store: Store, settings: Settings, *, now: float | None = None) -> dict[str, Any]:
    """Both, in the order that keeps every sample until its hour is rolled up (the embedded scheduler's job)."""
    now = time.time() if now is None else now
    return {"rollup": rollup_hours(store, settings, now=now), "retention": retain(store, settings, now=now)}


def detect_telemetry(store: Store, settings: Settings, *, now: float | None = None) -> dict[str, Any]:
    """Run the telemetry detectors over their window ending now; findings are recorded idempotently.

    The fleet's recoverable and held GPU-hours per day come from the one waste function (analyzer.waste).
    """
    found = detect(store, now, chunk_devices=settings.detect_chunk_devices,
                   silent_limit_s=settings.silent_device_limit_s)
    found = [*found, *detect_serving(store, now=now)]  # serving workflows: judged by latency, not utilisation
    _, w = rank_with_waste(store, now)
    return {"findings": len(found), "by_rule": dict(Counter(f.rule for f in found)),
            "workflows": sorted({f.workflow_id for f in found}),
            "recoverable_gpu_hours_per_day": round(w.recoverable_gpu_hours_per_day, 3),
            "held_gpu_hours_per_day": round(w.held_gpu_hours_per_day, 3), "problems": w.problems[:20]}


def analyze_traces(store: Store, settings: Settings, *, limit: int | None = None) -> dict[str, int]:
    """Analyse every registered trace not analysed yet, and every one a dead run left half-way; returns
    {"analyzed": n, "failed": m}."""
    return analyze_pending(store, limit=limit, cache_dir=settings.home / "cache" / "traces", host_id=settings.host_id,
                           bounds=TraceBounds.from_settings(settings), claims=ClaimPolicy.from_settings(settings))


def trace_batches(store: Store, settings: Settings) -> list[list[int]]:
    """The traces not analysed yet, in batches of `settings.analyze_batch_size` (one mapped Airflow task each)."""
    return pending_batches(store, settings.analyze_batch_size, ClaimPolicy.from_settings(settings))


def analyze_trace_batch(store: Store, settings: Settings, trace_ids: list[int]) -> dict[str, list[int]]:
    """Analyse one batch of traces; returns their ids by outcome ({"analyzed", "failed", "skipped"})."""
    return analyze_batch(store, [int(i) for i in trace_ids], cache_dir=settings.home / "cache" / "traces",
                         host_id=settings.host_id, bounds=TraceBounds.from_settings(settings),
                         claims=ClaimPolicy.from_settings(settings))


def slurm_gpus_without_process(store: Store, settings: Settings, *, now: float | None = None) -> int:
    """Record a finding per running Slurm job holding GPUs on a watched node where none of its processes runs;
    returns how many (analyzer.slurm_holders)."""
    return find_slurm_holders_without_processes(store, now=now)


def analyze(store: Store, settings: Settings, *, now: float | None = None) -> dict[str, Any]:
    """Telemetry detectors, then pending traces (the embedded scheduler's job; the DAG runs them as two tasks), and
    the Slurm jobs holding GPUs that no process uses."""
    return {"telemetry": detect_telemetry(store, settings, now=now), "traces": analyze_traces(store, settings),
            "slurm_without_process": slurm_gpus_without_process(store, settings, now=now)}
