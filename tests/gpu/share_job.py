"""A GPU job for the `gpu` tests: checks from inside that its memory share (FLEETLENS_MEMORY_FRACTION, applied by
the job SDK) holds on cuda:0: an allocation within the share succeeds, one beyond it fails with an out-of-memory
error, and the job goes on afterwards. Its last stdout line is a JSON summary.
"""

from __future__ import annotations

import json

import torch

from collector.job import job


def main() -> int:
    result: dict[str, object] = {}
    with job("gpu-share", total_steps=2) as j:
        fraction = j.memory_fraction_applied
        result["applied"] = fraction
        total = torch.cuda.get_device_properties(0).total_memory
        share = int(total * (fraction or 1.0))
        within = torch.empty(share // 2, dtype=torch.uint8, device="cuda")
        within.fill_(1)
        try:
            beyond = torch.empty(share, dtype=torch.uint8, device="cuda")  # with `within`: 1.5 shares
            result["beyond_refused"] = False
            del beyond
        except torch.cuda.OutOfMemoryError as exc:
            result["beyond_refused"] = True
            result["error"] = str(exc).splitlines()[0]
        after = torch.empty(share // 4, dtype=torch.uint8, device="cuda")  # still within: the job goes on
        after.fill_(2)
        for _ in j.steps():
            within.add_(1)
        torch.cuda.synchronize()
        result["reserved"] = torch.cuda.memory_reserved(0)
        result["share"] = share
        result["steps"] = j.step
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
