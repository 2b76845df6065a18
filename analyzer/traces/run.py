"""Analyse trace files: parse or read the cache, summarise each rank, run the rules; a bad file never stops the rest."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from analyzer.rules import TraceFinding, load_thresholds, rules_not_judged, run_rules, run_set_rules
from analyzer.rules.straggler import straggler_verdict
from analyzer.traces.cache import TraceBounds, load_trace
from analyzer.traces.errors import InvalidTrace
from analyzer.traces.memory import release_freed_memory
from analyzer.traces.parse import ParsedTrace
from analyzer.traces.stream_read import TruncatedTrace
from analyzer.traces.summary import summarize

log = logging.getLogger(__name__)
TRACE_SUFFIXES = (".json", ".json.gz")
Progress = Callable[[str, str], None]  # (path, stage) -> None
ReadProgress = Callable[[str, int, int, int], None]  # (path, file bytes read, file size, events read)


@dataclass
class AnalysisResult:
    """What an analysis of one or more trace files found."""

    summaries: list[dict[str, Any]] = field(default_factory=list)
    findings: list[TraceFinding] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)  # path -> problem
    straggler: dict[str, Any] | None = None

    @property
    def failed(self) -> bool:
        return bool(self.errors)

    def as_dict(self, gpus: int = 1) -> dict[str, Any]:
        return {"traces": self.summaries, "findings": [f.as_dict(gpus) for f in self.findings],
                "straggler": self.straggler, "errors": self.errors}


def expand_paths(paths: Iterable[str | Path]) -> list[Path]:
    """Trace files named directly, and the *.json / *.json.gz files inside named folders."""
    out: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            found = sorted(f for f in p.iterdir() if f.is_file() and f.name.endswith(TRACE_SUFFIXES))
            if not found:
                raise InvalidTrace(str(p), "is a folder with no .json or .json.gz trace files")
            out.extend(found)
        else:
            out.append(p)
    return out


def job_ranks(summaries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The summaries that are distinct ranks of one distributed job, else []: one world size, captured together
    (their capture windows overlap, one after another), each rank once. Of several such sets, the one with the most
    ranks. Summaries stored before capture windows were kept are grouped by world size alone, as they were."""
    by_world: dict[int, list[dict[str, Any]]] = {}
    for s in summaries:
        if s.get("world_size") and s["world_size"] > 1 and s.get("rank") is not None:
            by_world.setdefault(s["world_size"], []).append(s)
    captures: list[list[dict[str, Any]]] = []
    for members in by_world.values():
        untimed = [s for s in members if not s.get("window_us")]
        if untimed:
            captures.append(untimed)
        current: list[dict[str, Any]] = []
        end = 0.0
        for s in sorted((s for s in members if s.get("window_us")), key=lambda s: s["window_us"][0]):
            start, stop = s["window_us"]
            if current and start > end:  # begins after every capture so far ended: another job, or another time
                captures.append(current)
                current = []
            end = max(end, stop) if current else stop
            current.append(s)
        if current:
            captures.append(current)
    best: dict[int, dict[str, Any]] = {}
    for capture in captures:
        ranks: dict[int, dict[str, Any]] = {}
        for s in capture:
            if s["rank"] in ranks:
                log.warning("%s and %s are both rank %s of one capture; comparing the first",
                            ranks[s["rank"]].get("path"), s.get("path"), s["rank"])
                continue
            ranks[s["rank"]] = s
        if len(ranks) > len(best):
            best = ranks
    return list(best.values()) if len(best) >= 2 else []


def _summarize(parsed: ParsedTrace, th: dict) -> tuple[dict[str, Any], list[TraceFinding]]:
    summary = summarize(parsed, consecutive_kernel_delay_us=th["common"]["consecutive_kernel_delay_us"],
                        tiny_kernel_us=th["common"]["tiny_kernel_us"])
    summary["rules_not_judged"] = rules_not_judged(summary)
    return summary, run_rules(summary, th)


def analyze_one(path: str | Path, *, thresholds: dict | None = None, cache_dir: Path | None = None,
                memory_budget: int | None = None, progress: Progress | None = None,
                read_progress: ReadProgress | None = None, bounds: TraceBounds = TraceBounds()
                ) -> tuple[dict[str, Any], list[TraceFinding]]:
    """Summary and per-rank findings of one trace file; raises InvalidTrace for a bad file (TruncatedTrace, with
    the summary and findings of its complete steps as `partial_result`, for a file cut short).

    The file is read by the streaming reader within `bounds` (the caller's settings: trace_block_mb, trace_memory_mb;
    `memory_budget`, in bytes, overrides the latter)."""
    th = thresholds or load_thresholds()
    if progress:
        progress(str(path), "parsing")
    try:
        parsed = load_trace(path, cache_dir=cache_dir, memory_budget=memory_budget, bounds=bounds,
                            read_progress=(lambda *a: read_progress(str(path), *a)) if read_progress else None)
    except TruncatedTrace as exc:
        if exc.partial is not None:
            exc.partial_result = _summarize(exc.partial, th)
            exc.partial = None
        raise
    if progress:
        progress(str(path), "analysing")
    result = _summarize(parsed, th)
    del parsed
    release_freed_memory()  # the next rank of the job starts from the same size
    return result


def analyze_paths(paths: Iterable[str | Path], *, thresholds: dict | None = None, cache_dir: Path | None = None,
                  memory_budget: int | None = None, progress: Progress | None = None,
                  read_progress: ReadProgress | None = None, bounds: TraceBounds = TraceBounds()) -> AnalysisResult:
    """Analyse trace files (one rank per file, read one after another: a job's ranks share one memory bound) and
    the set they form; bad files land in `errors`, and a truncated file's complete steps are still analysed."""
    th = thresholds or load_thresholds()
    result = AnalysisResult()
    files: list[Path] = []
    for raw in paths:
        try:
            files.extend(expand_paths([raw]))
        except InvalidTrace as exc:
            result.errors[exc.path] = exc.problem
    for f in files:
        try:
            summary, found = analyze_one(f, thresholds=th, cache_dir=cache_dir, memory_budget=memory_budget,
                                         progress=progress, read_progress=read_progress, bounds=bounds)
        except TruncatedTrace as exc:
            log.warning("%s", exc)
            result.errors[exc.path] = exc.problem
            partial = getattr(exc, "partial_result", None)
            if partial is not None:
                result.summaries.append(partial[0])
                result.findings.extend(partial[1])
            continue
        except InvalidTrace as exc:
            log.warning("%s", exc)
            result.errors[exc.path] = exc.problem
            continue
        result.summaries.append(summary)
        result.findings.extend(found)
    ranks = job_ranks(result.summaries)
    if ranks:
        result.straggler = straggler_verdict(ranks, th["straggler"]["excess_min"])
        result.findings.extend(run_set_rules(ranks, th))
    if progress:
        progress("", "done")
    return result
