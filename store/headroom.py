"""Salus's memory headroom, the one home of its constants: what a job of measured memory is charged and asks for.

A job with persistent memory P and per-iteration ephemeral peak E (as measured: the store keeps P and E, never a
product with the headroom) is charged P' = 1.1 P and asks for a lane of L = 1.05 (P' + E) (the Salus code's
admission). The enforcer's lanes, the simulator, consolidation's sizing and the analyzer's "lane of N GiB" advice
all take the factors from here, so they never drift apart. It lives in store/ because both the analyzer and the
enforcer read it and neither may import the other.
"""

from __future__ import annotations

import math

PERSISTENT_FACTOR = 1.1  # P' = 1.1 P
LANE_FACTOR = 1.05  # L = 1.05 (P' + E)
LANE_HEADROOM = PERSISTENT_FACTOR * LANE_FACTOR  # a lane for a job of peak M and no ephemeral part: 1.155 M


def charged(persistent: int) -> int:
    """P': the persistent memory a lane charges a job of measured persistent memory `persistent`."""
    return math.ceil(PERSISTENT_FACTOR * max(0, persistent))


def lane_size(p_prime: int, ephemeral: int) -> int:
    """L: the lane (bytes, at least one) a job of charged P' and ephemeral E asks for, before any device's cap."""
    return max(1, math.ceil(LANE_FACTOR * (p_prime + max(0, ephemeral))))

