"""Terminal report of a trace analysis: rich tables per rank, the straggler verdict, findings, errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from analyzer.traces.names import kernel_label
from analyzer.traces.run import AnalysisResult


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1%}"


def _ms(us: float | None) -> str:
    return "n/a" if us is None else f"{us / 1e3:.2f}"


def _rank_tables(s: dict[str, Any]) -> list[Table]:
    name = Path(s["path"]).name
    head = Table(title=f"rank {s['rank']} — {name}", show_header=False, title_justify="left")
    dk = s.get("device_kind") or {}
    head.add_row("device", f"{dk.get('label', 'unknown device')}: {s['device'] or '-'} ({dk.get('why', '')})")
    head.add_row("steps", f"{s['n_steps']} ({', '.join(str(x['name']) for x in s['steps'][:4])}"
                          f"{', ...' if s['n_steps'] > 4 else ''})")
    head.add_row("mean step", f"{_ms(s['step_us_mean'])} ms")
    fr = s["fractions"]
    if fr["idle"] is None:
        # no device time in this trace: say why once instead of a row of n/a cells
        head.add_row("device time", dk.get("no_timeline_reason") or "none: this trace has no device")
    by_reason: dict[str, list[str]] = {}
    for rule, why in (s.get("rules_not_judged") or {}).items():
        by_reason.setdefault(why, []).append(rule.removeprefix("trace."))
    for why, rules in by_reason.items():
        head.add_row(f"not judged: {', '.join(rules)}", why)
    timeline = fr["idle"] is not None
    if timeline:
        head.add_row("computation / communication / memory / idle",
                     " / ".join(_pct(fr[k]) for k in ("computation", "communication", "memory", "idle")))
        head.add_row("idle: host wait / kernel wait / other",
                     " / ".join(_pct(fr[k]) for k in ("host_wait", "kernel_wait", "other_idle")))
        la = s["launch"]
        head.add_row("kernels per step", f"{la['kernels_per_step']:.0f} ({la['tiny_share']:.0%} under "
                                         f"{la['tiny_kernel_us']:.0f} us)")
        ov = s["overlap"]
        head.add_row("comm/comp overlap", _pct(ov["overlap_ratio"]) if ov["overlap_ratio"] is not None
                     else "no communication kernels")
        head.add_row("tensor-core share of compute", _pct(s["tensor_cores"]["tensor_core_share"]))
    head.add_row("DataLoader share of step", _pct(s["dataloader"]["share"]))
    tot = s["sync"]["totals"]
    head.add_row("sync calls (stream/device/event/.item)",
                 f"{tot['stream_sync']}/{tot['device_sync']}/{tot['event_sync']}/{tot['item']} "
                 f"({s['sync']['per_step_mean']:.1f} per step)")
    for w in s["warnings"]:
        head.add_row("warning", w)
    tables = [head]

    steps = Table(title="time per step (ms)", title_justify="left")
    parts = ("computation_us", "communication_us", "memory_us", "idle_us", "host_wait_us", "kernel_wait_us",
             "other_idle_us") if timeline else ()
    for col in ("step", "wall", "compute", "comm", "memory", "idle", "host wait", "kernel wait", "other")[
            :2 + len(parts)]:
        steps.add_column(col, justify="right")
    for r in s["breakdown"]:
        steps.add_row(str(r["step"]), _ms(r["step_us"]), *(_ms(r[k]) for k in parts))
    tables.append(steps)

    if s["top_kernels"]:
        k = Table(title="top kernels", title_justify="left")
        k.add_column("kernel", justify="left")
        for col in ("kind", "count", "total ms", "mean us", "share"):
            k.add_column(col, justify="right", no_wrap=True, min_width=max(len(col), 5))
        for r in s["top_kernels"]:
            # one line a kernel: the column narrows to what the numbers leave, the name ends in an ellipsis
            name = Text(kernel_label(r["name"]), no_wrap=True, overflow="ellipsis")
            k.add_row(name, r["kind"], str(r["count"]), _ms(r["total_us"]), f"{r['mean_us']:.1f}", _pct(r["share"]))
        tables.append(k)
    if s["memcpy"]:
        m = Table(title="memory copies", title_justify="left")
        for col in ("direction", "host memory", "count", "MiB", "ms", "GB/s"):
            m.add_column(col, justify="right")
        for r in s["memcpy"]:
            bw = "n/a" if r["bandwidth_gbps"] is None else f"{r['bandwidth_gbps']:.1f}"
            m.add_row(r["direction"], r["host_memory"], str(r["count"]), f"{r['bytes'] / 2**20:.1f}",
                      _ms(r["total_us"]), bw)
        tables.append(m)
    return tables


def print_report(result: AnalysisResult, console: Console, gpus: int = 1) -> None:
    for s in result.summaries:
        for table in _rank_tables(s):
            console.print(table)
        console.print()
    if result.straggler:
        v = result.straggler
        verdict = "straggler" if v["is_straggler"] else "no straggler"
        per = ", ".join(f"rank {r}: {_ms(us)} ms" for r, us in v["per_rank_us"].items())
        console.print(f"[bold]ranks compared[/bold] ({v['metric']}): {per}; slowest rank {v['slowest_rank']} "
                      f"{v['excess']:+.1%} vs median of others -> {verdict} (threshold {v['threshold']:.0%})")
    if result.findings:
        t = Table(title=f"findings (GPU-hours/day projected: the job assumed to run 24 h a day on {gpus} "
                        f"GPU{'s' if gpus != 1 else ''}, no telemetry)", title_justify="left")
        for col in ("severity", "rule", "rank", "finding", "ms/step", "GPU-h/day"):
            t.add_column(col)
        for f in sorted(result.findings, key=lambda f: -f.gpu_hours_per_day(gpus)):
            t.add_row(f.severity, f.rule.removeprefix("trace."), f.subject, f.title,
                      f"{f.cost_s_per_step * 1e3:.2f}", f"{f.gpu_hours_per_day(gpus):.2f}")
        console.print(t)
        for f in result.findings:
            console.print(f"[bold]{f.rule}[/bold] ({f.subject}) where: {f.location}", highlight=False)
            console.print(f"  fix: {f.fix}", highlight=False)
    elif result.summaries:
        console.print("no antipatterns found")
    for path, problem in result.errors.items():
        console.print(f"[red]failed[/red] {path}: {problem}", highlight=False)
