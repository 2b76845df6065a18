"""Lane gate round trip: a job's `gate begin` request answered by the agent's real socket server, SDK handlers and
LaneGate, against a bare echo round trip on the same socket and connection in the same run (the anchor).

Prints one JSON line: median and p95 microseconds of the gate's begin round trip, of a whole step's gate traffic
(begin + end), and of the echo; their ratio; and the 200 µs target.
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
    }))


if __name__ == "__main__":
    main()
