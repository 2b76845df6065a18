"""Lane gate round trip: a job's `gate begin` request answered by the agent's real socket server, SDK handlers and
LaneGate, against a bare echo round trip on the same socket and connection in the same run (the anchor).

Prints one JSON line: median and p95 microseconds of the gate's begin round trip, of a whole step's gate traffic
(begin + end), and of the echo; their ratio; and the 200 µs target.

On a GPU host also (and the cost per step of giving a turn's cached memory back, against keeping it): two
lane-mates (threads, each on its own CUDA stream, as two processes would be) take turns
through a LaneGate, each ending its turn with the job SDK's CUDA step waiter; from CUDA timing events around every
step's kernels, the fraction of the lane-mates' kernel time that overlaps (target 0), and the per-step cost of
waiting on the event (microseconds spent in the waiter beyond the step's own kernel time), against the same steps
run alone without a gate or a waiter (the anchor). Without a GPU these are null, with the reason.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from collector import protocol as p  # noqa: E402
from collector.sdk_handlers import SdkHandlers  # noqa: E402
from collector.socket_server import SocketServer  # noqa: E402
from enforcer.gate import LaneGate  # noqa: E402
from store.db import Store  # noqa: E402
from store.migrations import upgrade  # noqa: E402
from store.settings import Settings  # noqa: E402

N = 20_000
WARMUP = 2_000
TARGET_US = 200.0


GPU_STEPS = 200
GPU_MATMULS = 8  # kernels per step: enough GPU time per step that an unsynchronised hand-off would overlap


def gpu_figures() -> dict[str, Any]:
    """Kernel overlap of two lane-mates and the event wait's cost per step, or nulls with the reason."""
    import torch

    from collector.job import cuda_step_waiter

    if not torch.cuda.is_available():
        return {"kernel_overlap_fraction": None, "event_wait_us_per_step": None, "turn_release_us_per_step": None,
                "gpu_reason": "no CUDA device here (torch.cuda.is_available() is False)"}
    import threading

    size = 2048
    gate = LaneGate("pack")  # lane-mates alternate step by step
    ref = torch.cuda.Event(enable_timing=True)
    ref.record()
    torch.cuda.synchronize()

    def steps(name: str, out: list[Any], gated: bool) -> None:
        stream = torch.cuda.Stream()
        a = torch.randn(size, size, device="cuda")
        stream.wait_stream(torch.cuda.current_stream())  # `a` is made on the default stream
        with torch.cuda.stream(stream):
            wait = cuda_step_waiter(torch)
            for step in range(GPU_STEPS):
                if gated:
                    gate.begin("1", (name, 0, 0), step)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                b = a
                for _ in range(GPU_MATMULS):
                    b = b @ a
                end.record()
                t0 = time.perf_counter()
                if gated:
                    wait()
                waited = time.perf_counter() - t0
                if gated:
                    gate.end("1", (name, 0, 0))
                out.append((start, end, waited))
            stream.synchronize()

    def intervals(rows: list[Any]) -> list[tuple[float, float]]:
        return [(ref.elapsed_time(s) * 1e3, ref.elapsed_time(e) * 1e3) for s, e, _ in rows]  # microseconds

    alone: list[Any] = []
    steps("alone", alone, gated=False)
    torch.cuda.synchronize()
    kernel_us = sum(e - s for s, e in intervals(alone)) / len(alone)
    runs: dict[str, list[Any]] = {"a": [], "b": []}
    threads = [threading.Thread(target=steps, args=(name, rows, True)) for name, rows in runs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.cuda.synchronize()
    ia, ib = intervals(runs["a"]), intervals(runs["b"])
    overlap = 0.0
    j = 0
    ib.sort()
    for s, e in sorted(ia):
        while j < len(ib) and ib[j][1] <= s:
            j += 1
        k = j
        while k < len(ib) and ib[k][0] < e:
            overlap += max(0.0, min(e, ib[k][1]) - max(s, ib[k][0]))
            k += 1
    total = sum(e - s for s, e in ia) + sum(e - s for s, e in ib)
    waited_us = [w * 1e6 for rows in runs.values() for _, _, w in rows]
    return {
        "kernel_overlap_fraction": round(overlap / total, 6) if total else None,
        "event_wait_us_per_step": round(max(0.0, statistics.mean(waited_us) - kernel_us), 1),
        "event_wait_us_per_step_incl_kernels": round(statistics.mean(waited_us), 1),
        "kernel_us_per_step_alone": round(kernel_us, 1), **release_cost(torch), "gpu_reason": None,
    }


def release_cost(torch: Any) -> dict[str, Any]:
    """What giving a turn's memory back costs per step (collector.turns.TurnMemory: empty_cache at each turn's end,
    so the next step allocates its ephemeral memory from the driver again), against the same steps keeping PyTorch's
    cache (the anchor): median microseconds per step of both."""
    a = torch.randn(2048, 2048, device="cuda")

    def run(release: bool) -> float:
        times = []
        for _ in range(GPU_STEPS):
            t0 = time.perf_counter()
            scratch = [a @ a for _ in range(4)]  # the step's ephemeral memory: 4 x 16 MiB
            del scratch
            torch.cuda.synchronize()
            if release:
                torch.cuda.empty_cache()
            times.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(times)

    run(False)  # warm up
    kept, released = run(False), run(True)
    return {"step_us_keeping_cache": round(kept, 1), "step_us_releasing_cache": round(released, 1),
            "turn_release_us_per_step": round(released - kept, 1)}


class EchoOrSdk:
    """The agent's SDK handlers, plus an `echo` op answered with nothing done: the bare socket round trip."""

    def __init__(self, sdk: SdkHandlers) -> None:
        self.sdk = sdk

    def handle(self, msg: dict[str, Any]) -> dict[str, Any] | None:
        if msg.get("op") == "echo":
            return {"ok": True}
        return self.sdk.handle(msg)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    home = Path(tempfile.mkdtemp(prefix="fleetlens-gate-bench-"))
    settings = Settings(home=home, secret="bench")
    settings.ensure_home()
    store = Store.from_settings(settings)
    upgrade(store)
    sdk = SdkHandlers(store, "bench-host", settings)
    sdk.gate = LaneGate("fifo")
    server = SocketServer(settings.socket_path, EchoOrSdk(sdk)).start()
    conn = p.AgentConnection(settings.socket_path, timeout_s=5.0)
    base = {"v": p.VERSION, "workflow": "bench", "pid": os.getpid(), "rank": 0}
    echo = {**base, "op": "echo"}
    try:
        echo_us, begin_us, step_us = [], [], []
        clock = time.perf_counter
        print(f"lane gate: {N} steps after {WARMUP} warm-up ...", file=sys.stderr)
        for i in range(WARMUP + N):
            t0 = clock()
            conn.request(echo)
            t1 = clock()
            reply = conn.request({**base, "op": p.GATE, "lane": "1", "step": i, "phase": "begin"}, wait_forever=True)
            t2 = clock()
            conn.request({**base, "op": p.GATE, "lane": "1", "step": i, "phase": "end"})
            t3 = clock()
            if not reply.get("granted"):
                raise SystemExit(f"the gate did not grant step {i}: {reply}")
            if i >= WARMUP:
                echo_us.append((t1 - t0) * 1e6)
                begin_us.append((t2 - t1) * 1e6)
                step_us.append((t3 - t1) * 1e6)
    finally:
        conn.close()
        server.stop()
        sdk.close()
        store.dispose()
    gate_median = statistics.median(begin_us)
    echo_median = statistics.median(echo_us)
    print(json.dumps({
        "benchmark": "lane_gate", "steps": N,
        "gate_round_trip_median_us": round(gate_median, 1),
        "gate_round_trip_p95_us": round(percentile(begin_us, 0.95), 1),
        "step_gate_traffic_median_us": round(statistics.median(step_us), 1),
        "echo_round_trip_median_us": round(echo_median, 1),
        "echo_round_trip_p95_us": round(percentile(echo_us, 0.95), 1),
        "ratio_gate_to_echo": round(gate_median / echo_median, 3), "target_us": TARGET_US,
        "meets_target": gate_median <= TARGET_US,
        **gpu_figures(),
    }))


if __name__ == "__main__":
    main()
