"""Agent CPU per second of sampling 8 GPUs x 32 processes at 1 Hz, writes to SQLite included, against a bare
loop that makes the same NVML calls and nothing else. One JSON line on stdout; progress on stderr.

NVML is tests/fakes/fake_pynvml (no GPU here) read through the real `nvml` source. Its processes are real:
256 sleeping children, 8 workflows (FLEETLENS_WORKFLOW in their environment), so attribution, the process
table and the process samples do the work they would on a real host.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from collector.agent import Agent  # noqa: E402
from collector.sources.nvml import NvmlSource  # noqa: E402
from store.db import Store  # noqa: E402
from store.migrations import upgrade  # noqa: E402
from store.settings import Settings  # noqa: E402
from tests.fakes.fake_pynvml import fleet  # noqa: E402

N_GPUS, PROCS_PER_GPU = 8, 32
INTERVAL_S, FLUSH_S = 1.0, 10.0
DURATION_S = float(os.environ.get("FLEETLENS_BENCH_DURATION_S", "30"))
TARGET = 0.01


def progress(msg: str) -> None:
    print(f"[collector_overhead] {msg}", file=sys.stderr, flush=True)


class CallRecorder:
    """Wraps the fake NVML and records every function call one source sample makes, to replay them bare."""

    def __init__(self, nvml) -> None:
        self._nvml = nvml
        self.calls: list[tuple[object, tuple]] | None = None

    def __getattr__(self, name: str):
        attr = getattr(self._nvml, name)
        if self.calls is None or not name.startswith("nvml") or not callable(attr):
            return attr

        def call(*args):
            self.calls.append((attr, args))
            return attr(*args)

        return call


@contextmanager
def fake_fleet() -> Iterator[Any]:
    """The fake NVML's N_GPUS x PROCS_PER_GPU fleet, each of its processes a real (sleeping) process of a workflow
    of its own GPU, so that attribution reads real /proc entries; the processes are stopped at the end."""
    children = []
    try:
        for k in range(N_GPUS * PROCS_PER_GPU):
            env = {**os.environ, "FLEETLENS_WORKFLOW": f"bench-job-{k // PROCS_PER_GPU}"}
            children.append(subprocess.Popen(["sleep", "600"], env=env))
        fake = fleet(N_GPUS, PROCS_PER_GPU)
        for g, gpu in enumerate(fake.gpus):
            for k, proc in enumerate(gpu.processes):
                proc.pid = children[g * PROCS_PER_GPU + k].pid
        yield fake
    finally:
        for child in children:
            child.kill()
        for child in children:
            child.wait()


def cpu_per_second(run, seconds: float) -> float:
    """CPU seconds this process used per wall second while `run` ran (the agent's threads included)."""
    cpu0, wall0 = time.process_time(), time.monotonic()
    run(seconds)
    return (time.process_time() - cpu0) / (time.monotonic() - wall0)


def bare_loop(calls: list[tuple[object, tuple]], seconds: float) -> None:
    start = time.monotonic()
    tick = 0
    while True:
        for fn, args in calls:
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 - the same errors the source swallows (e.g. "no samples")
                pass
        tick += 1
        next_at = start + tick * INTERVAL_S
        if next_at - start > seconds:
            return
        time.sleep(max(0.0, next_at - time.monotonic()))


def main() -> None:
    with fake_fleet() as fake:
        with tempfile.TemporaryDirectory() as tmp:
            home = Path(tmp) / "home"
            settings = Settings(home=home, secret="bench", host_id="bench-host")
            settings.ensure_home()
            store = Store(settings.resolved_db_url)
            upgrade(store)

            # the anchor: exactly the NVML calls one sample makes, replayed with nothing around them
            recorder = CallRecorder(fake)
            probe = NvmlSource(nvml=recorder)
            probe.sample()  # GPM needs one sample before it reads metrics: record the steady-state call list
            recorder.calls = []
            probe.sample()
            calls = recorder.calls
            recorder.calls = None
            probe.close()
            progress(f"one sample = {len(calls)} NVML calls; bare loop for {DURATION_S:.0f} s")
            bare = cpu_per_second(lambda s: bare_loop(calls, s), DURATION_S)

            source = NvmlSource(nvml=fake)
            agent = Agent(store, settings, source, sample_interval_s=INTERVAL_S, flush_interval_s=FLUSH_S)
            progress(f"agent for {DURATION_S:.0f} s ({N_GPUS} GPUs x {PROCS_PER_GPU} processes, SQLite)")
            agent.start()

            def run_agent(seconds: float) -> None:
                time.sleep(seconds)

            # Registration, first attribution and the first flush (which records every process once) are
            # start-up, not steady state: measure from after that flush.
            time.sleep(FLUSH_S + 2 * INTERVAL_S)
            used = cpu_per_second(run_agent, DURATION_S)
            agent.stop()
            stats = agent.stats
            store.dispose()
        line = {
            "case": "collector_overhead",
            "gpus": N_GPUS,
            "procs_per_gpu": PROCS_PER_GPU,
            "interval_s": INTERVAL_S,
            "flush_interval_s": FLUSH_S,
            "duration_s": DURATION_S,
            "database": "sqlite",
            "agent_cpu_fraction": round(used, 5),
            "bare_nvml_cpu_fraction": round(bare, 5),
            "ratio": round(used / bare, 2) if bare > 0 else None,
            "target_cpu_fraction": TARGET,
            "meets_target": used <= TARGET,
            "device_rows": stats.device_rows,
            "process_rows": stats.process_rows,
            "batches_written": stats.batches_written,
        }
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
