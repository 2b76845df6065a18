"""FIFO, the baseline: no sharing. Each job gets whole devices, the first empty ones, in arrival order."""

from __future__ import annotations

from typing import ClassVar

from enforcer.discipline import JOB_ORDER
from enforcer.policies.base import Policy


class Fifo(Policy):
    name: ClassVar[str] = "fifo"
    lane_order: ClassVar[str] = JOB_ORDER
    description: ClassVar[str] = "baseline: whole devices, first fit, arrival order (no sharing)"
    exclusive: ClassVar[bool] = True
