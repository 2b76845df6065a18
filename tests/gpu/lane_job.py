"""A GPU job for the `gpu` tests: CUDA matrix products under the job SDK, profiled, its trace written where told.

`python -m tests.gpu.lane_job --trace PATH` runs `--steps` steps of `--matmuls` products of two `--size` square
matrices on `--device` (cuda), each step one SDK step (so in a lane each step waits for its turn), and writes the
profiler's Kineto trace of the whole run to PATH. Its last stdout line is a JSON summary.
"""

from __future__ import annotations

import argparse
import json

import torch
from torch.profiler import ProfilerActivity, profile

from collector.job import job


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--size", type=int, default=2048)
    ap.add_argument("--matmuls", type=int, default=8)
    ap.add_argument("--device", default="cuda", help="cpu runs the same loop without kernels (a check of the script)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    a = torch.randn(args.size, args.size, device=device)
    b = torch.randn(args.size, args.size, device=device) / args.size**0.5
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=activities) as prof, job("gpu-lane-mate", total_steps=args.steps) as j:
        for _ in j.steps():
            for _ in range(args.matmuls):
                a = torch.tanh(a @ b)  # queued on the GPU: the Python step returns long before the kernels end
        if cuda:
            torch.cuda.synchronize()
    prof.export_chrome_trace(args.trace)
    print(json.dumps({"steps": j.step, "connected": j.connected, "checksum": float(a.float().sum().item())}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
