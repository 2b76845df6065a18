"""Which Slurm jobs to move onto fewer shards, and what to advise the rest: pure (holdings in, moves and advice out).

A job on `s` shards of a GPU split into `k` holds s/k of it. Using `u` of a whole GPU (p95 over the window, by its
samples), it needs ceil(u * k / cap) shards (at least one), k being the most shards any GPU of its node has: Slurm may
spread a node's shards unevenly (store.slurm.shards_by_gpu), and the requeued job may land on any of its GPUs, so
its new shards hold what it uses wherever it lands. A job that opted in and holds more is moved to that many
(one move per job per cycle, the busiest GPUs' jobs never). A job that did not opt in, or asked for whole GPUs, gets
advice naming what it holds, what it uses and what it would need to be moved (Slurm 23.02.6 for a `gpu` request).
A job whose use is unknown (no samples yet) is left alone: nothing is planned on a guess. Lane admission still
decides who may share a GPU: a job whose memory is not known yet (FLEETLENS_MEMORY_SEEN_STEPS) runs alone first,
and where the GPU's memory is known a job gets at least the shards whose share of it holds its Salus lane,
1.05 (1.1 P + E).

A move requeues the job, and the actuator gives it its fewer shards on the node it runs on (it checks that node's
room): that node is the move's target as well as its source. So a job on a node not heard from (`SlurmHolding.
not_heard_from`: the import has not listed it lately, or Slurm reports it down or not responding) or on a node that
takes no new job (`closed`: drained, draining, in maintenance or reserved, where the requeued job could not start
again) is not moved: it is counted in the plan's `skipped` under NOT_HEARD_FROM or NODE_CLOSED.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from enforcer.actuators.base import Move
from enforcer.planner import NOT_HEARD_FROM
from store.headroom import charged, lane_size
from store.slurm import GPU_TO_SHARD_VERSION, OPT_IN_WORD, SDK_OPT_IN


@dataclass(frozen=True)
class SlurmHolding:
    workflow_id: str
    job_id: int
    gres_kind: str  # gpu | shard
    count: int  # GPUs or shards requested
    shards_per_gpu: int  # the most shards any GPU of its node has (store.slurm.finest_shards)
    used: float | None  # p95 use of one whole GPU, 0..1 (None: no samples)
    opted_in: bool
    not_movable_reason: str | None = None
    device_id: int | None = None  # the store's device of the GPU it holds now
    memory: tuple[int, int] | None = None  # (P, E) when known well enough to share a GPU (enforcer admission's rule)
    device_memory: int | None = None  # bytes of the GPU it holds, when an agent reported them
    node: str | None = None  # the node it runs on (its batch script's)
    not_heard_from: str | None = None  # why its node is not heard from (store.registry.silent_hosts); None: it is
    closed: str | None = None  # why its node takes no new job (store.registry.closed_hosts); None: it takes them


@dataclass(frozen=True)
class SlurmAdvice:
    workflow_id: str
    message: str


# the skipped-count key of jobs kept on a node that takes no new job: the requeued job could not start there again
NODE_CLOSED = "on a node that takes no new job"


def needed_shards(used: float, shards_per_gpu: int, util_cap: float = 1.0) -> int:
    return max(1, math.ceil(round(used * shards_per_gpu / util_cap, 6)))


def plan_slurm_moves(holdings: list[SlurmHolding], *, busy: frozenset[str] = frozenset(), max_moves: int = 4,
                     util_cap: float = 1.0, policy: str | None = None,
                     ) -> tuple[list[Move], list[SlurmAdvice], dict[str, int]]:
    """Moves for opted-in shard jobs that hold more shards than they use; advice for the others that do (`busy`:
    workflows with an unfinished move, left out); and the jobs that would have been moved but for their node,
    counted by why (NOT_HEARD_FROM, NODE_CLOSED)."""
    moves: list[Move] = []
    advice: list[SlurmAdvice] = []
    skipped: dict[str, int] = {}
    for h in sorted(holdings, key=lambda h: (h.used if h.used is not None else 1.0, h.job_id)):
        if h.used is None or h.workflow_id in busy or h.shards_per_gpu <= 0:
            continue
        want = needed_shards(h.used, h.shards_per_gpu, util_cap)
        if h.memory is None:
            want = max(want, h.count)  # unknown memory runs alone first: it keeps what it holds
        elif h.device_memory:
            lane = lane_size(charged(h.memory[0]), h.memory[1])
            want = max(want, math.ceil(lane / (h.device_memory / h.shards_per_gpu)))
        if h.gres_kind == "gpu":
            if h.used * h.shards_per_gpu < h.count * h.shards_per_gpu - 1:
                advice.append(SlurmAdvice(h.workflow_id, (
                    f"holds {h.count} whole GPU(s) and uses {h.used:.0%} of one: it would fit on {want} shard(s); "
                    f"a job that asked for `gpu` can be moved to shards only from Slurm {GPU_TO_SHARD_VERSION} on, so "
                    f"resubmit it with --gres=shard:N (and opted in: --comment={OPT_IN_WORD}, or {SDK_OPT_IN}) to let "
                    "fleetlens move it")))
            continue
        if want >= h.count:
            continue
        if not h.opted_in:
            advice.append(SlurmAdvice(h.workflow_id, (
                f"holds {h.count} shards and uses {h.used:.0%} of a GPU ({want} would do); fleetlens only advises: "
                f"{h.not_movable_reason}")))
            continue
        kept = NOT_HEARD_FROM if h.not_heard_from is not None else NODE_CLOSED if h.closed is not None else None
        if kept is not None:
            skipped[kept] = skipped.get(kept, 0) + 1
            continue
        if len(moves) < max_moves:
            moves.append(Move(workflow_id=h.workflow_id, to_device_id=h.device_id or 0, from_device_id=h.device_id,
                              compute_share=want / h.shards_per_gpu, policy=policy, request={"gres": f"shard:{want}"},
                              reason=f"holds {h.count} shards, uses {h.used:.0%} of a GPU: {want} shard(s) will do"))
    return moves, advice, skipped
