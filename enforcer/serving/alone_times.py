"""Per-request ("alone") execution times recovered from measured batch times, under the batch-cost model.

The serving SDK measures each request's batch's time. A batch B runs for g(|B|) * max of its members' own times
(enforcer.serving.distribution.batch_cost), so within a batch-size class of mean size b, with H the class's
batch-time CDF and F the per-request one (members independent), H(y) = F(y / g(b))^b, hence

    P(own time <= t) = H(g(b) t)^(1/b).

Each class gives such an estimate of the same F; they are combined weighted by the class's batches (each batch is
one observation). What comes back is a sample of F at evenly spaced quantiles, for the simulator to fit and draw
from like measured times. For a class of one request per batch (b = 1) this is its measured times, unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from enforcer.serving.distribution import batch_cost
from store import latency_sketch as ls
from store.batch_sizes import SizeClass
from store.errors import InvalidInput

MAX_SAMPLES = 10_000  # quantile points returned at most: the CDF's resolution is the histograms' 2 % anyway


def alone_cdf(by_batch: Mapping[int, SizeClass], alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """(times, F(times)): the per-request CDF at every point where one of the classes' estimates steps."""
    classes = [sc for sc in by_batch.values() if sc.n]
    if not classes:
        raise InvalidInput("alone times: no batch-size class with requests to recover them from")
    parts = []
    for sc in classes:
        keys = sorted(sc.hist)
        values = np.array([ls.value(k) for k in keys])
        h = np.cumsum([sc.hist[k] for k in keys]) / sc.n
        b = sc.mean_size
        parts.append((values / _g(b, alpha), h, 1.0 / b, sc.batches))
    times = np.unique(np.concatenate([t for t, _, _, _ in parts]))
    weight = sum(w for _, _, _, w in parts)
    cdf = np.zeros(len(times))
    for t, h, inv_b, w in parts:
        # this class's estimate at each point: H at the largest of its (scaled) values <= the point, ^ (1 / b)
        at = np.searchsorted(t, times * (1 + 1e-12), side="right") - 1
        cdf += w * np.where(at >= 0, h[np.clip(at, 0, None)] ** inv_b, 0.0)
    return times, np.minimum(cdf / weight, 1.0)


def alone_samples(by_batch: Mapping[int, SizeClass], alpha: float, size: int | None = None) -> np.ndarray:
    """A sample of the per-request time distribution: its quantiles at (j + 0.5) / size, size the classes' requests
    (at most MAX_SAMPLES) unless given."""
    times, cdf = alone_cdf(by_batch, alpha)
    if size is None:
        size = min(sum(sc.n for sc in by_batch.values()), MAX_SAMPLES)
    q = (np.arange(size) + 0.5) / size
    return times[np.minimum(np.searchsorted(cdf, q, side="left"), len(times) - 1)]


def _g(b: float, alpha: float) -> float:
    """g at a mean batch size (the class's, possibly not whole): 1 + alpha log2 b."""
    batch_cost(1, alpha)  # checks alpha
    return 1.0 + alpha * float(np.log2(b))
