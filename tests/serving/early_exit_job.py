"""A real serving job for the tests: an early-exit torch model on the CPU behind the distribution-aware request
queue (enforcer.serving.live), recorded by the SDK's serving mode (collector.serving) into the host's agent.

Two applications of one model, each its own batching group: `dynamic` requests exit after a number of layers that
varies widely from request to request (the input says how hard it is), `static` ones always run the same layers.
A batch runs until its last member exits. The job first profiles each application (its execution-time
distribution), then serves requests a producer thread submits at seeded random times.

With `--stop-running` the queue gives each batch a `stop_at`: the model asks `RequestQueue.past_stop` before each layer
and, once it is, gives the batch up (`RequestQueue.stop`) inside `rec.batch(batch)`; its requests are recorded as
shed, once (the SDK does not record a batch given up as served).

    python -m tests.serving.early_exit_job --workflow W --requests 300 --devices 4 --slo-dynamic 1.2
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from collector.serving import ServingRecorder
from enforcer.serving.distribution import Distributions, TimeGrid
from enforcer.serving.live import RequestQueue

LAYERS = 24
WIDTH = 512
REPEAT = 48  # each layer applied this many times: a request takes milliseconds, above the CPU's jitter
STATIC_LAYERS = 6


class EarlyExit(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))

    @torch.no_grad()
    def forward(self, x: torch.Tensor, exits: torch.Tensor,
                give_up: Callable[[], bool] | None = None) -> tuple[torch.Tensor, int]:
        """Each row leaves after exits[i] layers; the batch runs until its last row has left, or until `give_up`,
        asked before each layer, says so. Returns the output and the layers run."""
        out = x.clone()
        run = 0
        for depth, layer in enumerate(self.layers, start=1):
            alive = exits >= depth
            if not bool(alive.any()) or (give_up is not None and give_up()):
                break
            h = out[alive]
            for _ in range(REPEAT):
                h = torch.tanh(layer(h))
            out[alive] = h
            run = depth
        return out, run


def exit_depth(app: str, rng: np.random.Generator) -> int:
    if app == "static":
        return STATIC_LAYERS
    return int(np.clip(rng.geometric(0.15), 1, LAYERS))  # most exit early, a long tail runs deep


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workflow", required=True)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--slo-dynamic", type=float, default=1.2, help="SLO as a multiple of the profiled median")
    ap.add_argument("--slo-static", type=float, default=50.0, help="SLO as a multiple of the profiled median")
    ap.add_argument("--slo-floor", type=float, default=0.0, help="no SLO shorter than this (seconds)")
    ap.add_argument("--max-batch", type=int, default=2)
    ap.add_argument("--rate", type=float, default=40.0, help="requests per second, both apps together")
    ap.add_argument("--stop-running", action="store_true", help="give a batch up at the queue's stop_at")
    ap.add_argument("--eps", type=float, default=0.05, help="the queue's drop threshold")
    ap.add_argument("--stop-eps", type=float, default=0.05, help="the stop threshold (at most --eps)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(1)
    model = EarlyExit()
    apps = ("dynamic", "static")

    def run(depths: list[int], give_up: Callable[[], bool] | None = None) -> int:
        x = torch.randn(len(depths), WIDTH)
        return model(x, torch.tensor(depths), give_up)[1]

    # profile: each application alone, batch of one, to fit its execution-time distribution
    profile: dict[str, list[float]] = {a: [] for a in apps}
    for _ in range(60):
        for a in apps:
            t0 = time.thread_time()
            run([exit_depth(a, rng)])
            profile[a].append(time.thread_time() - t0)
    samples = {a: np.array(v) for a, v in profile.items()}
    grid = TimeGrid.covering(max(float(v.max()) for v in samples.values()) * 4)
    dists = Distributions.fit(grid, samples)
    med = {a: float(np.median(v)) for a, v in samples.items()}
    slos = {"dynamic": max(args.slo_floor, args.slo_dynamic * med["dynamic"]),
            "static": max(args.slo_floor, args.slo_static * med["static"])}
    queue = RequestQueue(dists, slos, alpha=0.1, eps=args.eps, max_batch=args.max_batch,
                         stop_running=args.stop_running, stop_eps=args.stop_eps)
    payload_rng = np.random.default_rng(2)
    done = threading.Event()

    def produce() -> None:
        for _ in range(args.requests):
            time.sleep(payload_rng.exponential(1.0 / args.rate))
            app = apps[int(payload_rng.integers(2))]
            queue.submit(app, exit_depth(app, payload_rng))
        done.set()

    producer = threading.Thread(target=produce)
    producer.start()
    served = shed = 0
    stops: list[dict] = []  # each batch given up: when it was to stop and did stop; the layers run and needed
    with ServingRecorder(args.workflow, slos=slos, devices=args.devices) as rec:
        while not (done.is_set() and queue.pending() == 0):
            batch = queue.next_batch(timeout=0.05)
            for r in queue.dropped():
                rec.shed(r.app, [r.arrival])
                shed += 1
            if batch is None:
                continue
            with rec.batch(batch, cpu_time=True):  # a batch given up in the body is recorded as shed only
                layers = run(batch.payloads, give_up=lambda b=batch: queue.past_stop(b))
                if layers < max(batch.payloads):  # given up before its last member exited
                    queue.stop(batch)
                    stops.append({"stop_at": batch.stop_at, "stopped": queue.clock(), "layers": layers,
                                  "needed": max(batch.payloads)})
            if batch.given_up:
                continue  # its requests come back from queue.dropped() and are recorded as shed
            served += len(batch.requests)
        for r in queue.dropped():
            rec.shed(r.app, [r.arrival])
            shed += 1
    producer.join()
    print(json.dumps({"served": served, "shed": shed, "submitted": queue.submitted, "recorded": rec.recorded,
                      "sent": rec.sent, "lost": rec.lost, "slos": slos, "medians": med, "stopped": queue.stopped,
                      "stops": stops}))


if __name__ == "__main__":
    main()
