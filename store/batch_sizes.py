"""A serving minute's execution times kept per batch-size class, so that what batching does to a batch's time is
never taken for the model's own variation.

A request's execution time is its batch's, and a batch's time grows with its size. Each minute therefore keeps, per
batch-size class, the class's request count `n`, the sum of its requests' batch sizes `batch_sum` (so its mean batch
size is batch_sum / n) and a histogram of its requests' execution times (store.latency_sketch). Requests are
counted, not batches: every batch of size b adds b counts of its time, so within one size the distribution is the
same as per batch, and the SDK needs no batch membership to record it.

Classes: the exact size up to EXACT_UP_TO, then powers of two, class 2^k holding the sizes in (2^(k-1), 2^k]; the
largest, TOP_CLASS, holds every size above half of it too. So a minute holds at most len(CLASSES) histograms
whatever the sizes. JSON form: {"<class>": {"n": int, "batch_sum": int, "hist": {bucket: count}}}.

A minute has them only when every part of it had them (like `met`): a part recorded without (rows stored before
revision 0016, an SDK from before it) makes the merged minute's None, and readers fall back to the histogram over
all sizes for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from store import latency_sketch as ls
from store.errors import InvalidInput

EXACT_UP_TO = 8
TOP_CLASS = 1 << 16
CLASSES = (*range(1, EXACT_UP_TO + 1), *(1 << k for k in range(EXACT_UP_TO.bit_length(), TOP_CLASS.bit_length())))
_CLASS_SET = frozenset(CLASSES)


def size_class(b: int) -> int:
    """The class of batch size b >= 1."""
    if b <= EXACT_UP_TO:
        return b
    return min(1 << (b - 1).bit_length(), TOP_CLASS)


def class_sizes(c: int) -> tuple[int, float]:
    """The smallest and largest batch size class c holds (the top class has no largest)."""
    if c <= EXACT_UP_TO:
        return c, float(c)
    return c // 2 + 1, float("inf") if c == TOP_CLASS else float(c)


def class_label(c: int) -> str:
    """How a class reads for a person: '4', '9-16', '>32768'."""
    lo, hi = class_sizes(c)
    if lo == hi:
        return str(c)
    return f">{lo - 1}" if hi == float("inf") else f"{lo}-{c}"


@dataclass(slots=True)
class SizeClass:
    """One batch-size class of a minute (or window): requests, their batch sizes' sum, their execution times."""

    n: int = 0
    batch_sum: int = 0
    hist: ls.Hist = field(default_factory=dict)

    @property
    def mean_size(self) -> float:
        """The class's mean batch size (over its requests)."""
        return self.batch_sum / self.n if self.n else 0.0

    @property
    def batches(self) -> float:
        """Its batches: exact within one size; within a range, n² / batch_sum, a lower bound (Cauchy-Schwarz)."""
        return self.n * self.n / self.batch_sum if self.batch_sum else 0.0


ByBatch = dict[int, SizeClass]


def add(into: ByBatch, other: Mapping[int, SizeClass]) -> ByBatch:
    """Add checked classes into `into` (copies, never shares a histogram)."""
    for c, sc in other.items():
        cur = into.get(c)
        if cur is None:
            cur = into[c] = SizeClass()
        cur.n += sc.n
        cur.batch_sum += sc.batch_sum
        for k, v in sc.hist.items():
            cur.hist[k] = cur.hist.get(k, 0) + v
    return into


def merge_parts(a: ByBatch | None, a_n: int, b: ByBatch | None, b_n: int) -> ByBatch | None:
    """The classes of two parts of one minute: their sum, or None when a part that served requests has none (a part
    that served none has nothing to add, whatever it says)."""
    a = {} if a_n == 0 else a
    b = {} if b_n == 0 else b
    if a is None or b is None:
        return None
    return add(add({}, a), b)


def to_json(by: Mapping[int, SizeClass] | None) -> dict[str, dict[str, Any]] | None:
    if by is None:
        return None
    return {str(c): {"n": sc.n, "batch_sum": sc.batch_sum, "hist": ls.to_json(sc.hist)}
            for c, sc in sorted(by.items()) if sc.n}


def from_json(data: Any, what: str = "exec_by_batch") -> ByBatch | None:
    """Classes from their JSON form, each checked on its own (InvalidInput names what is wrong); None stays None."""
    if data is None:
        return None
    if not isinstance(data, Mapping):
        raise InvalidInput(f"{what}: must map batch-size classes to their requests, not {type(data).__name__}")
    out: ByBatch = {}
    for key, v in data.items():
        try:
            c = int(key) if not isinstance(key, bool | float) else None
        except ValueError:
            c = None
        if c not in _CLASS_SET:
            raise InvalidInput(f"{what}: {key!r} is not a batch-size class (1 to {EXACT_UP_TO}, then powers of two "
                               f"up to {TOP_CLASS})")
        if not isinstance(v, Mapping):
            raise InvalidInput(f"{what}: class {c} must be an object with n, batch_sum and hist")
        n, batch_sum = v.get("n"), v.get("batch_sum")
        for name, x in (("n", n), ("batch_sum", batch_sum)):
            if isinstance(x, bool) or not isinstance(x, int) or x < 0:
                raise InvalidInput(f"{what}: class {c}'s {name}={x!r} is not a whole number >= 0")
        hist = ls.from_json(v.get("hist"))
        if ls.total(hist) != n:
            raise InvalidInput(f"{what}: class {c}'s histogram counts {ls.total(hist)} requests, its n says {n}")
        lo, hi = class_sizes(c)
        if not n * lo <= batch_sum <= n * hi:
            raise InvalidInput(f"{what}: class {c} holds batch sizes {class_label(c)}, so its {n} requests' batch "
                               f"sizes cannot add up to {batch_sum}")
        if c in out:
            raise InvalidInput(f"{what}: class {c} appears twice")
        out[c] = SizeClass(n, batch_sum, hist)
    return out


def check_totals(by: Mapping[int, SizeClass] | None, n: int, batch_sum: int, what: str) -> None:
    """The classes of a minute hold each of its requests once: their counts add up to n, their batch sizes to the
    minute's batch_sum."""
    if by is None:
        return
    got_n = sum(sc.n for sc in by.values())
    if got_n != n:
        raise InvalidInput(f"{what}: exec_by_batch counts {got_n} requests, n says {n}")
    got_b = sum(sc.batch_sum for sc in by.values())
    if got_b != batch_sum:
        raise InvalidInput(f"{what}: exec_by_batch's batch sizes add up to {got_b}, batch_sum says {batch_sum}")
