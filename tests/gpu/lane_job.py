"""A GPU job for the `gpu` tests: CUDA matrix products under the job SDK, profiled, its trace written where told.

`python -m tests.gpu.lane_job --trace PATH` runs `--steps` steps of `--matmuls` products of two `--size` square
matrices on `--device` (cuda), each step one SDK step (so in a lane each step waits for its turn), and writes the
profiler's Kineto trace of the whole run to PATH. 4096² products take milliseconds each on any GPU, far longer
than the gate's socket round trip, so a turn that ended before its kernels did would show as overlap.
`--no-wait` removes the SDK's wait for the step's device work (a waiter that returns at once): the control run that
shows the overlap test can fail. Its last stdout line is a JSON summary, written while the job is still open
(so `connected` says whether it reached the agent).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

from collector.job import job


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--matmuls", type=int, default=8)
    ap.add_argument("--device", default="cuda", help="cpu runs the same loop without kernels (a check of the script)")
    ap.add_argument("--no-wait", action="store_true", help="hand the turn on without waiting for the step's kernels")
    ap.add_argument("--start-at", type=float, default=0.0,
                    help="epoch seconds to start stepping at (lane-mates started together, whatever their start-up)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    a = torch.randn(args.size, args.size, device=device)
    b = torch.randn(args.size, args.size, device=device) / args.size**0.5
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    if cuda:
        torch.cuda.synchronize()
    step_done = (lambda: None) if args.no_wait else None
    time.sleep(max(0.0, args.start_at - time.time()))  # CUDA is up and the matrices made: now step together
    started = time.perf_counter()
    with profile(activities=activities) as prof:
        with job("gpu-lane-mate", total_steps=args.steps, step_done=step_done) as j:
            for _ in j.steps():
                for _ in range(args.matmuls):
                    a = torch.tanh(a @ b)  # queued on the GPU: the Python step returns long before the kernels end
            if cuda:
                torch.cuda.synchronize()
            summary = {"steps": j.step, "connected": j.connected, "lane": j.lane, "renewals": j.renewals,
                       "step_wait_s": j.step_wait_s, "wall_s": time.perf_counter() - started,
                       "no_wait": args.no_wait}
    prof.export_chrome_trace(args.trace)
    summary["checksum"] = float(a.float().sum().item())
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
