"""The order in which the jobs of one lane take steps under each policy: the one rule the live lane gate
(enforcer.gate) and the simulator (enforcer.sim) both follow. Each policy names its order (`Policy.lane_order`).

  fifo   job order: the job that came to the lane first takes every step until it is done (Salus's FIFO: one job
         at a time); at a step boundary it keeps the turn while it asks again.
  pack   round robin: steps in the order they were asked for, so lane-mates alternate step by step.
  fair   least attained: the job with the least step time so far goes next (Salus's FAIR).
  srtf   least remaining: the job with the least expected time left goes next, preempting at a step boundary.
         A job's time left is its declared steps left x its measured step time, so a job that declared its steps
         but has not taken one yet (`Turn.probe`) takes one step first, to be measured: otherwise it could never
         be measured while a job with a known time held the lane, and SRTF would be FIFO. A job that declared no
         steps has no time left to compare: it goes after the others.

A job that just ended a step is a candidate for the next one alongside the waiting jobs (asked now, after them).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

JOB_ORDER = "job_order"
ROUND_ROBIN = "round_robin"
LEAST_ATTAINED = "least_attained"
LEAST_REMAINING = "least_remaining"

# which of these a policy follows is the policy's own `Policy.lane_order` (enforcer.policies)


@dataclass(slots=True)
class Turn:
    """One job asking for the lane's next step."""

    key: Hashable
    arrival: float  # when the job first came to the lane (job order)
    asked: float  # when it asked for this step (round robin)
    attained_s: float = 0.0
    remaining_s: float | None = None
    probe: bool = False  # its time left is unknown only for want of a measured step (least remaining: goes first)


def sort_key(kind: str, t: Turn) -> tuple:
    if kind == ROUND_ROBIN:
        head: tuple = (t.asked,)
    elif kind == LEAST_ATTAINED:
        head = (t.attained_s,)
    elif kind == LEAST_REMAINING:
        if t.remaining_s is not None:
            head = (1, t.remaining_s)
        else:
            head = (0, 0.0) if t.probe else (2, math.inf)
    else:
        head = ()
    return (*head, t.arrival, str(t.key))


def next_turn(kind: str, turns: Iterable[Turn]) -> Turn | None:
    """Who takes the next step."""
    return min(turns, key=lambda t: sort_key(kind, t), default=None)


def shares(kind: str, turns: list[Turn]) -> dict[Hashable, float]:
    """Each job's share of the lane's steps for a while, for a simulator that does not step: round robin shares
    equally; least attained shares among those tied for least; the others give every step to the next job."""
    if not turns:
        return {}
    if kind == ROUND_ROBIN:
        return {t.key: 1.0 / len(turns) for t in turns}
    if kind == LEAST_ATTAINED:
        low = min(t.attained_s for t in turns)
        group = [t for t in turns if t.attained_s <= low + 1e-6]
        return {t.key: 1.0 / len(group) for t in group}
    chosen = next_turn(kind, turns)
    return {chosen.key: 1.0} if chosen is not None else {}


@dataclass(slots=True)
class StepJob:
    key: Hashable
    arrival: float
    steps: int
    step_s: float


def step_order(kind: str, jobs: list[StepJob]) -> list[Hashable]:
    """The lane's steps one by one, as the gate would grant them: which job took each step."""
    left = {j.key: j.steps for j in jobs if j.steps > 0}
    by_key = {j.key: j for j in jobs}
    done = dict.fromkeys(by_key, 0)
    asked = {j.key: j.arrival for j in jobs}
    now = min((j.arrival for j in jobs), default=0.0)
    order: list[Hashable] = []
    while left:
        ready = [k for k in left if by_key[k].arrival <= now]
        if not ready:
            now = min(by_key[k].arrival for k in left)
            continue
        # as the gate knows it: a job's step time is measured, so its remaining time is unknown before its first step
        turns = [Turn(k, by_key[k].arrival, asked[k], done[k] * by_key[k].step_s,
                      left[k] * by_key[k].step_s if done[k] else None, probe=not done[k]) for k in ready]
        chosen = next_turn(kind, turns)
        assert chosen is not None
        k = chosen.key
        order.append(k)
        now += by_key[k].step_s
        done[k] += 1
        left[k] -= 1
        asked[k] = now  # it asks again the moment its step ends
        if left[k] == 0:
            del left[k]
    return order
