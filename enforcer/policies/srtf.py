"""SRTF: the job with the least remaining time (declared steps left x measured seconds per step) takes the next
iteration; placement packs like PACK. Jobs whose remaining time is unknown go after those whose is known, in the
queue and in a lane, except in a lane a job that declared its steps and has not yet taken one: it takes one step
first, to be measured (enforcer.discipline)."""

from __future__ import annotations

import math
from typing import ClassVar

from enforcer.discipline import LEAST_REMAINING
from enforcer.lanes import Job
from enforcer.policies.pack import Pack


class Srtf(Pack):
    name: ClassVar[str] = "srtf"
    lane_order: ClassVar[str] = LEAST_REMAINING
    description: ClassVar[str] = "least remaining time goes next; packs like PACK"

    def priority(self, job: Job) -> tuple[float, ...]:
        return (math.inf if job.remaining_s is None else job.remaining_s,)
