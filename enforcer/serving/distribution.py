"""Per-application execution-time distributions on one shared time grid, and the batch-cost curve g(b).

Every application's empirical CDF is tabulated on the same grid (`step` seconds a cell, `cells` cells), so a
candidate batch's time CDF is one numpy product: a batch of requests B runs for g(|B|) * max(t_i), hence
P(T_B <= y) = prod_i F_i(y / g(|B|)) (independent members). The grid is conservative: F(x) is read at the cell
that holds x, rounded down, so a probability of meeting a deadline is never overstated by the grid.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from store.errors import InvalidInput

DEFAULT_CELLS = 1024


def batch_cost(b: int, alpha: float) -> float:
    """g(b) = 1 + alpha * log2(b): how much longer a batch of b runs than its longest member alone."""
    if not (alpha >= 0 and math.isfinite(alpha)):  # NaN fails the first test
        raise InvalidInput(f"batch cost alpha={alpha}: a finite number >= 0 (g(b) = 1 + alpha log2 b; a batch never "
                           "runs faster than its longest member alone)")
    if b < 1:
        raise InvalidInput(f"batch size {b}: a batch holds at least one request")
    return 1.0 + alpha * math.log2(b)


@dataclass(frozen=True)
class TimeGrid:
    """Cells [i*step, (i+1)*step); `index(x)` is the cell of x, clipped to the grid."""

    step: float
    cells: int = DEFAULT_CELLS

    @classmethod
    def covering(cls, max_time: float, cells: int = DEFAULT_CELLS) -> TimeGrid:
        if cells < 2:
            raise InvalidInput(f"time grid: at least 2 cells, not {cells}")
        if not max_time > 0 or not math.isfinite(max_time):
            raise InvalidInput(f"time grid: the longest execution time must be positive and finite, not {max_time}")
        return cls(max_time * 1.0001 / (cells - 1), cells)

    def index(self, x: float) -> int:
        if x < 0:
            return -1
        i = int(x / self.step)
        return i if i < self.cells else self.cells - 1

    def indices(self, x: np.ndarray) -> np.ndarray:
        """Cells of many times; negative times give -1 (callers read probability 0 there)."""
        return np.floor(np.clip(np.asarray(x, dtype=float) / self.step, -1.0, self.cells - 1)).astype(np.int64)


class Distributions:
    """Empirical execution-time CDFs of each application (rows of `cdf`, plus a column of zeros at the end so
    that index -1 reads 0), with each one's mean and median."""

    def __init__(self, grid: TimeGrid, apps: Sequence[str], samples: Sequence[np.ndarray]) -> None:
        if len(apps) != len(samples):
            raise InvalidInput("distributions: one sample array per application")
        self.grid = grid
        self.apps = list(apps)
        self.index_of = {a: i for i, a in enumerate(self.apps)}
        n = len(self.apps)
        self.cdf = np.zeros((n, grid.cells + 1))
        self.mean = np.zeros(n)
        self.median = np.zeros(n)
        self.count = np.zeros(n, dtype=np.int64)
        for i, s in enumerate(samples):
            s = np.asarray(s, dtype=float)
            if s.size == 0:
                raise InvalidInput(f"application {self.apps[i]!r}: no execution times to fit a distribution on")
            if not np.all(np.isfinite(s)) or np.any(s <= 0):
                raise InvalidInput(f"application {self.apps[i]!r}: execution times must be positive and finite")
            cells = grid.indices(s)
            counts = np.bincount(cells, minlength=grid.cells)[: grid.cells]
            self.cdf[i, : grid.cells] = np.cumsum(counts) / s.size
            self.mean[i] = float(s.mean())
            self.median[i] = float(np.median(s))
            self.count[i] = s.size

    @classmethod
    def fit(cls, grid: TimeGrid, samples: Mapping[str, np.ndarray]) -> Distributions:
        apps = sorted(samples)
        return cls(grid, apps, [samples[a] for a in apps])

    @classmethod
    def point_masses(cls, grid: TimeGrid, apps: Sequence[str], times: np.ndarray) -> Distributions:
        """Each 'application' a single known time: what an oracle plans with."""
        return cls(grid, apps, [np.array([t]) for t in times])

    def p_within(self, app: np.ndarray, x: np.ndarray) -> np.ndarray:
        """P(t_app <= x) for arrays of application indices and times."""
        return self.cdf[app, self.grid.indices(x)]

    def expected_time(self, cdf_row: np.ndarray) -> float:
        """E[T] of a CDF on the grid (upper cell edges: never an underestimate)."""
        return float(self.grid.step * np.sum(1.0 - cdf_row[: self.grid.cells]))

    def quantile(self, app: int, q: float) -> float:
        row = self.cdf[app, : self.grid.cells]
        return float((int(np.searchsorted(row, q)) + 1) * self.grid.step)
