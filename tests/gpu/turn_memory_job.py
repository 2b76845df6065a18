"""A GPU job for the `gpu` tests: a lane job's memory caps on cuda:0, from inside. During its turn it may hold its
whole share (FLEETLENS_MEMORY_FRACTION); once the turn ends the SDK has given the step's cached memory back
(empty_cache) and its cap is the persistent share (FLEETLENS_IDLE_MEMORY_FRACTION), so an allocation past that
fails. Its last stdout line is a JSON summary.
"""

from __future__ import annotations

import json

import torch

from collector.job import job


def main() -> int:
    result: dict[str, object] = {}
    total = torch.cuda.get_device_properties(0).total_memory
    with job("gpu-turn-memory", total_steps=3) as j:
        turn, idle = j.memory_fraction_applied or 1.0, j.settings.idle_memory_fraction or 1.0
        persistent = torch.empty(int(total * idle * 0.5), dtype=torch.uint8, device="cuda")
        persistent.fill_(1)
        peaks = []
        for _ in j.steps():
            scratch = torch.empty(int(total * (turn - idle * 0.5) * 0.9), dtype=torch.uint8, device="cuda")
            scratch.fill_(2)  # within the turn's share: persistent + most of the ephemeral room
            peaks.append(torch.cuda.memory_reserved(0))
            del scratch
        result["turn_reserved_max"] = max(peaks)
        result["after_turn_reserved"] = torch.cuda.memory_reserved(0)  # the turn's cache was given back
        try:
            beyond = torch.empty(int(total * idle * 0.8), dtype=torch.uint8, device="cuda")  # with persistent: 1.3
            result["beyond_idle_refused"] = False
            del beyond
        except torch.cuda.OutOfMemoryError:
            result["beyond_idle_refused"] = True
        result.update(turn=turn, idle=idle, total=total, steps=j.step, connected=j.connected)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
