"""Benchmark: analysing large traces in bounded memory, against a bare streaming decode of the same file.

Builds traces of 0.1, 0.5 and 2 GB of JSON text (gzipped on disk) by repeating the steps of the shared 16-rank A100
trace, each copy shifted in time past the one before and with fresh correlation, flow and external ids and
step numbers, written one copy at a time into a temporary folder (deleted afterwards). For each size, in fresh
subprocesses: our whole analysis (time, peak RSS: the process's VmHWM) and the anchor, a gunzip plus incremental decode
of every event with nothing kept (analyzer.traces.stream_json). One JSON line per size.
Targets: ours_peak_mib <= 1024 at 2 GB, growth from 0.5 to 2 GB <= 100 MiB, ratio_to_bare_stream <= 2.5.
`--ranks N MB`: N ranks of MB each analysed in one call against one alone (the ranks share the bound).
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT.parent / "shared" / "data" / "traces" / "a100_80gb_16rank_rank0_training.json.gz"
SIZES_MB = [100, 500, 2000]
ID_ARGS = ("correlation", "External id", "Ev Idx", "Python id", "Python parent id")

PEAK = """
import os
def cpu():  # this process's CPU time: on a shared machine, less swayed by other work than the wall clock
    t = os.times()
    return t.user + t.system
def peak():  # this process's own high-water mark (ru_maxrss would carry the parent's across exec)
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmHWM"))
"""

OURS = PEAK + """
import sys, time
from analyzer.traces.run import analyze_paths
import hta.common.trace_symbol_table, hta.utils.utils  # imported before the clock, as the anchor imports orjson
t, c = time.perf_counter(), cpu()
res = analyze_paths(sys.argv[1:])  # several files: the ranks of one job, read one after another
assert not res.errors, res.errors
print(time.perf_counter() - t, cpu() - c, peak(), res.summaries[0]["n_steps"])
"""

BARE = PEAK + """
import sys, time
from pathlib import Path
from analyzer.traces.stream_json import EventStream
t, c = time.perf_counter(), cpu()
n = 0
for batch in EventStream(Path(sys.argv[1]), 2 << 20).batches():  # the reader's default block (trace_block_mb)
    n += len(batch)
print(time.perf_counter() - t, cpu() - c, peak(), n)
"""


def _copy_source() -> tuple[dict, list[dict], list[dict]]:
    """The source trace's header keys, its once-only events (metadata, the profiler's own span) and its steps."""
    with gzip.open(SOURCE, "rb") as fh:
        record = orjson.loads(fh.read())
    events = record.pop("traceEvents")
    once = [e for e in events if e.get("ph") == "M" or e.get("cat") == "Trace"]
    repeat = [e for e in events if not (e.get("ph") == "M" or e.get("cat") == "Trace")]
    return record, once, repeat


def _shift(events: list[dict], dt: float, did: int, dstep: int) -> None:
    """Move one copy on: later in time, fresh ids, later step numbers (in place: one copy is held at a time)."""
    for e in events:
        if "ts" in e:
            e["ts"] += dt
        if "id" in e and isinstance(e["id"], int):
            e["id"] += did
        name = e.get("name")
        if isinstance(name, str) and name.startswith("ProfilerStep#"):
            e["name"] = f"ProfilerStep#{int(name[13:]) + dstep}"
        a = e.get("args")
        if isinstance(a, dict):
            for k in ID_ARGS:
                v = a.get(k)
                if isinstance(v, int) and v > 0:
                    a[k] = v + did


def build(path: Path, size_mb: int) -> int:
    """Write a trace of about size_mb MB of JSON text (pretty-printed, one event over several lines); returns its
    text size in bytes. Only one copy of the source's events is held at a time."""
    header, once, repeat = _copy_source()
    ts = [e["ts"] for e in repeat if "ts" in e]
    ends = [e["ts"] + e.get("dur", 0) for e in repeat if "ts" in e]
    span = max(ends) - min(ts) + 1000.0
    ids = [v for e in repeat for v in ([e.get("id")] + [(e.get("args") or {}).get(k) for k in ID_ARGS])
           if isinstance(v, int)]
    id_span = max(ids) + 1
    steps = [int(e["name"][13:]) for e in repeat if str(e.get("name", "")).startswith("ProfilerStep#")]
    step_span = max(steps) - min(steps) + 1
    target = size_mb * 1_000_000
    opt = orjson.OPT_INDENT_2
    written = 0
    with gzip.open(path, "wb", compresslevel=1) as out:
        head = orjson.dumps(header, option=opt)[:-2] + b',\n  "traceEvents": [\n'
        out.write(head)
        body = orjson.dumps(once, option=opt)[2:-2]
        out.write(body)
        written += len(head) + len(body)
        copy = 0
        while written + copy // 2 < target:  # the nearest whole number of copies
            _shift(repeat, span, id_span, step_span)
            body = b",\n" + orjson.dumps(repeat, option=opt)[2:-2]
            out.write(body)
            copy = len(body)
            written += copy
        tail = b"\n  ]\n}\n"
        out.write(tail)
        written += len(tail)
    return written


def _build_apart(path: Path, size_mb: int) -> int:
    """Build in a child process, so that this one stays small (its children are measured)."""
    out = subprocess.run([sys.executable, __file__, "--build", str(path), str(size_mb)], cwd=ROOT,
                         capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


def _measure(code: str, *paths: Path) -> tuple[float, float, int, int]:
    out = subprocess.run([sys.executable, "-c", code, *map(str, paths)], cwd=ROOT, capture_output=True, text=True,
                         check=True)
    secs, cpu_s, rss, n = out.stdout.split()[-4:]
    return float(secs), float(cpu_s), int(rss), int(n)


def _ranks(n: int, size_mb: int) -> None:
    """n ranks of size_mb each analysed together (one call), against one of them alone: the same bound."""
    with tempfile.TemporaryDirectory(prefix="fleetlens-trace-memory-") as tmp:
        one = Path(tmp) / "rank0.json.gz"
        _build_apart(one, size_mb)
        paths = [one]
        for r in range(1, n):
            paths.append(Path(tmp) / f"rank{r}.json.gz")
            paths[-1].hardlink_to(one)
        alone_s, _, alone_rss, _ = _measure(OURS, one)
        all_s, _, all_rss, _ = _measure(OURS, *paths)
        print(json.dumps({"ranks": n, "size_mb_each": size_mb, "one_rank_s": round(alone_s, 2),
                          "one_rank_peak_mib": round(alone_rss / 2**20, 1), "all_ranks_s": round(all_s, 2),
                          "all_ranks_peak_mib": round(all_rss / 2**20, 1)}), flush=True)


def main() -> None:
    if sys.argv[1:2] == ["--build"]:
        print(build(Path(sys.argv[2]), int(sys.argv[3])))
        return
    if sys.argv[1:2] == ["--ranks"]:
        _ranks(int(sys.argv[2]), int(sys.argv[3]))
        return
    sizes = [int(a) for a in sys.argv[1:]] or SIZES_MB
    with tempfile.TemporaryDirectory(prefix="fleetlens-trace-memory-") as tmp:
        for size_mb in sizes:
            path = Path(tmp) / f"trace_{size_mb}mb.json.gz"
            text = _build_apart(path, size_mb)
            print(f"# {size_mb} MB: {text / 1e6:.0f} MB of text, {path.stat().st_size / 1e6:.0f} MB gzipped",
                  file=sys.stderr, flush=True)
            bare_s, bare_cpu, bare_rss, events = _measure(BARE, path)
            ours_s, ours_cpu, ours_rss, steps = _measure(OURS, path)
            print(json.dumps({
                "size_mb": round(text / 1e6), "events": events, "steps": steps,
                "ours_s": round(ours_s, 2), "ours_peak_mib": round(ours_rss / 2**20, 1),
                "bare_stream_s": round(bare_s, 2), "bare_stream_peak_mib": round(bare_rss / 2**20, 1),
                "ratio_to_bare_stream": round(ours_s / bare_s, 2),
                "ours_cpu_s": round(ours_cpu, 2), "bare_stream_cpu_s": round(bare_cpu, 2),
                "cpu_ratio_to_bare_stream": round(ours_cpu / bare_cpu, 2),
            }), flush=True)
            path.unlink()


if __name__ == "__main__":
    main()
