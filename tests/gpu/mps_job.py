"""A GPU job for the `gpu` MPS test: as many 4096² matrix products as it can for `--seconds`, under whatever MPS
share its environment gives it (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE). Prints one JSON line: products per second,
and the SM count the device reports to this client."""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--start-at", type=float, default=0.0, help="epoch seconds to start at (both jobs together)")
    args = ap.parse_args()
    a = torch.randn(4096, 4096, device="cuda")
    b = torch.randn(4096, 4096, device="cuda") / 64.0
    torch.cuda.synchronize()
    time.sleep(max(0.0, args.start_at - time.time()))
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < args.seconds:
        for _ in range(8):
            a = torch.tanh(a @ b)
        torch.cuda.synchronize()
        done += 8
    elapsed = time.perf_counter() - start
    print(json.dumps({"matmuls_per_s": done / elapsed, "sms": torch.cuda.get_device_properties(0).multi_processor_count,
                      "checksum": float(a.float().sum().item())}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
