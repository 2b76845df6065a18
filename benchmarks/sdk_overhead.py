"""Per-step overhead of the job SDK: `j.steps()` over a loop with an empty body, against the bare loop.

Two cases, one JSON line each: no agent listening (the SDK's retry path), and an agent (SdkHandlers behind
the real socket server, in a separate process with its own SQLite store) that takes a summary every second.
Figures are medians over repeats of the mean per-step time; the target is at most 20 us of overhead.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from collector.job import job  # noqa: E402
from store.settings import Settings  # noqa: E402

STEPS = 200_000
REPEATS = 11
LIMIT_US = 20.0

SERVE = """
import sys, time
from store.db import Store
from store.migrations import upgrade
from store.settings import Settings
from collector.sdk_handlers import SdkHandlers
from collector.socket_server import SocketServer
s = Settings(home=sys.argv[1])
store = Store.from_settings(s); upgrade(store)
handlers = SdkHandlers(store, "bench-host", s)
with SocketServer(s.socket_path, handlers):
    print("ready", flush=True)
    sys.stdin.read()
handlers.close()
"""


def per_step_bare(n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        pass
    return (time.perf_counter() - t0) / n


def per_step_sdk(n: int, settings: Settings) -> float:
    with job("sdk-overhead", settings=settings) as j:
        t0 = time.perf_counter()
        for _ in j.steps(range(n)):
            pass
        return (time.perf_counter() - t0) / n


def measure(case: str, settings: Settings) -> dict:
    bare, sdk = [], []
    for i in range(REPEATS):
        print(f"# {case}: repeat {i + 1}/{REPEATS}", file=sys.stderr)
        bare.append(per_step_bare(STEPS))
        sdk.append(per_step_sdk(STEPS, settings))
    bare_us, sdk_us = statistics.median(bare) * 1e6, statistics.median(sdk) * 1e6
    overhead = sdk_us - bare_us
    return {
        "benchmark": "sdk_overhead", "case": case, "steps": STEPS, "repeats": REPEATS,
        "sdk_us_per_step_median": round(sdk_us, 3), "bare_us_per_step_median": round(bare_us, 3),
        "overhead_us_per_step_median": round(overhead, 3), "ratio": round(sdk_us / bare_us, 2),
        "limit_us": LIMIT_US, "within_limit": overhead <= LIMIT_US,
    }


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp) / "home"
        home.mkdir()
        base = {"home": home, "workflow": "bench-sdk-overhead", "db_url": f"sqlite:///{home / 'fleetlens.db'}"}
        print(json.dumps(measure("no_agent", Settings(**base))), flush=True)
        server = subprocess.Popen([sys.executable, "-c", SERVE, str(home)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parent.parent,
                                  env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
        try:
            if server.stdout.readline().strip() != "ready":
                raise SystemExit("the benchmark's agent did not start")
            settings = Settings(**base)
            line = measure("agent", settings)
            print(json.dumps(line), flush=True)
        finally:
            server.stdin.close()
            server.wait(timeout=30)


if __name__ == "__main__":
    main()
