"""Latency histograms with exact counts and quantiles good to 1 %: log-spaced buckets (DDSketch's mapping).

A value x > 0 goes to bucket i = ceil(log(x) / log(GAMMA)), which holds (GAMMA^(i-1), GAMMA^i]; a bucket is read
back as 2 GAMMA^i / (GAMMA + 1), within (GAMMA - 1) / (GAMMA + 1) < 1 % of every value in it. Histograms are
plain {bucket: count} dicts (JSON-friendly with string keys), merged by adding counts, so the SDK, the agent and
the store can each add what they have without losing a request. Used by the serving SDK, its store rows and the
serving findings.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Mapping

import numpy as np

from store.errors import InvalidInput

GAMMA = 1.02
RELATIVE_ERROR = (GAMMA - 1) / (GAMMA + 1)
_INV_LOG_GAMMA = 1.0 / math.log(GAMMA)

Hist = dict[int, int]


def _bucket(x: float) -> int:
    return math.ceil(math.log(x) * _INV_LOG_GAMMA)


def _largest_bucket() -> int:
    i = math.floor(math.log(sys.float_info.max) * _INV_LOG_GAMMA)
    while True:
        try:
            return i if math.isfinite(GAMMA ** i) else i - 1
        except OverflowError:
            i -= 1


# The buckets a positive, finite double can fall in whose value is itself finite: a key outside them (a histogram
# someone else wrote) is refused, so every reader can turn every stored bucket into seconds.
MIN_BUCKET = _bucket(math.ulp(0.0))
MAX_BUCKET = _largest_bucket()
_MAX_SECONDS = GAMMA ** MAX_BUCKET  # the largest value MAX_BUCKET holds


def bucket(x: float) -> int:
    """The bucket of a positive, finite value (seconds); InvalidInput for one too large to have a finite bucket."""
    if not (x > 0 and math.isfinite(x)):
        raise InvalidInput(f"latency sketch: {x!r} is not a positive, finite number of seconds")
    if x > _MAX_SECONDS:
        raise InvalidInput(f"latency sketch: {x!r} seconds is too large to be a time")
    return min(_bucket(x), MAX_BUCKET)  # a value at the very top may round up past it


def value(i: int) -> float:
    """What bucket i stands for: within RELATIVE_ERROR of anything in it."""
    return GAMMA ** i * (2.0 / (GAMMA + 1.0))  # finite for every bucket in [MIN_BUCKET, MAX_BUCKET]


def add(hist: Hist, x: float, count: int = 1) -> None:
    i = bucket(x)
    hist[i] = hist.get(i, 0) + count


def merge(into: Hist, other: Mapping[int | str, int]) -> Hist:
    """Add `other`'s counts into `into` (keys may be JSON strings); a negative or fractional count, or a key that is
    not a whole number in [MIN_BUCKET, MAX_BUCKET], is refused (InvalidInput, and `into` is left unchanged)."""
    checked = []
    for k, c in other.items():
        if isinstance(c, bool) or not isinstance(c, int) or c < 0:
            raise InvalidInput(f"latency sketch: bucket {k!r} has count {c!r}, not a whole number >= 0")
        try:
            i = int(k) if not isinstance(k, bool | float) else None
        except ValueError:
            i = None
        if i is None or not MIN_BUCKET <= i <= MAX_BUCKET:
            raise InvalidInput(f"latency sketch: bucket {k!r} is not a whole number in [{MIN_BUCKET}, {MAX_BUCKET}] "
                               "(the buckets of positive, finite times)")
        checked.append((i, c))
    for i, c in checked:
        into[i] = into.get(i, 0) + c
    return into


def to_json(hist: Mapping[int, int]) -> dict[str, int]:
    return {str(k): int(v) for k, v in hist.items() if v}


def from_json(data: Mapping[str, int] | None) -> Hist:
    return merge({}, data or {})


def total(hist: Mapping[int, int]) -> int:
    return int(sum(hist.values()))


def quantiles(hist: Mapping[int, int], qs: Iterable[float]) -> list[float]:
    """Quantiles (lower, rank floor(q (n - 1)) of the sorted values) to within RELATIVE_ERROR; NaN when empty."""
    qs = list(qs)
    n = total(hist)
    if n == 0:
        return [math.nan] * len(qs)
    keys = sorted(hist)
    cum = np.cumsum([hist[k] for k in keys])
    out = []
    for q in qs:
        if not 0.0 <= q <= 1.0:
            raise InvalidInput(f"quantile {q}: must be in [0, 1]")
        rank = math.floor(q * (n - 1))
        out.append(value(keys[int(np.searchsorted(cum, rank, side="right"))]))
    return out


def count_at_most(hist: Mapping[int, int], x: float) -> int:
    """How many values are <= x, to within one bucket (the bucket holding x counts in full)."""
    if x <= 0:
        return 0
    if x > _MAX_SECONDS:
        return total(hist)
    edge = bucket(x)
    return int(sum(c for k, c in hist.items() if k <= edge))


def samples(hist: Mapping[int, int]) -> np.ndarray:
    """Every counted value as its bucket's value (what a replay of the measured distribution draws from)."""
    if not hist:
        return np.zeros(0)
    keys = sorted(hist)
    return np.repeat([value(k) for k in keys], [hist[k] for k in keys])


def quartile_cv(hist: Mapping[int, int]) -> float:
    """The CV estimated from the quartiles, (q75 - q25) / (1.349 q50): the CV itself for a normal distribution, but
    not inflated by a few stalls (a shared host's other processes holding the core); NaN when empty."""
    q25, q50, q75 = quantiles(hist, (0.25, 0.5, 0.75))
    return (q75 - q25) / (1.349 * q50) if q50 and q50 > 0 else math.nan
