"""Co-location slowdown: how much two jobs sharing a device slow each other, measured (Lucid) or estimated.

The measured pairs (lucid_colocate_info.csv) give each job's speed next to the other, normalised to its speed
alone; lucid_single_data.csv gives each model's utilisation alone. Pairs that were not measured are estimated by
a least-squares fit of a job's co-located speed on the two jobs' solo utilisations (u_a, u_b in 0..1):

    speed_a = w . [1, u_a, u_b, u_a u_b, max(0, u_a + u_b - 1), max(0, u_a + u_b - 1)^2]

clipped to [MIN_SPEED, 1] (a job is never faster for having company; measured speeds above 1 are noise). The fit's
error on pairs held out from it is reported by `holdout_error`. Slowdown is the inverse of speed (>= 1).

The model is a handful of floats, so `slowdown` costs microseconds and `speed_array` scores a whole fleet at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np
import pandas as pd

from store.errors import InvalidInput

MIN_SPEED = 0.05
COLOCATE_FILE = "lucid_colocate_info.csv"
SINGLE_FILE = "lucid_single_data.csv"
COLOCATE_COLUMNS = ("model1", "batchsize1", "amp1", "speed1", "model2", "batchsize2", "amp2", "speed2")
SINGLE_COLUMNS = ("model", "batchsize", "amp", "gpu_util")

# Fitted on all 2 x 1,388 measured (job, neighbour) speeds of the Lucid data; `InterferenceModel.from_csv` refits
# them, and tests check that a refit gives the same numbers. Used when the data files are not at hand.
BUILTIN_WEIGHTS = (1.00717709, 0.04122475, -0.01385578, -0.30206707, -0.18105014, 0.08955702)


def _features(ua: np.ndarray, ub: np.ndarray) -> np.ndarray:
    over = np.maximum(0.0, ua + ub - 1.0)
    return np.stack([np.ones_like(ua), ua, ub, ua * ub, over, over * over], axis=-1)


def _speed(weights: np.ndarray, ua: np.ndarray, ub: np.ndarray) -> np.ndarray:
    return np.clip(_features(ua, ub) @ weights, MIN_SPEED, 1.0)


def _fit(ua: np.ndarray, ub: np.ndarray, speed: np.ndarray) -> np.ndarray:
    weights, *_ = np.linalg.lstsq(_features(ua, ub), speed, rcond=None)
    return weights


@dataclass
class InterferenceModel:
    """Estimated speeds from utilisation, plus the measured pairs when they were loaded."""

    weights: np.ndarray = field(default_factory=lambda: np.array(BUILTIN_WEIGHTS))
    # one row per (job, neighbour) measurement: model_a, model_b, ua, ub, speed, speed_b (normalised to alone)
    pairs: pd.DataFrame | None = None

    def __post_init__(self) -> None:
        self.weights = np.asarray(self.weights, dtype=np.float64)
        self._w = tuple(float(x) for x in self.weights)  # plain floats: the scalar path is hot in the simulator

    @classmethod
    def from_csv(cls, data_dir: Path) -> InterferenceModel:
        pairs = load_pairs(data_dir)
        weights = _fit(pairs.ua.to_numpy(), pairs.ub.to_numpy(), pairs.speed.to_numpy())
        return cls(weights=weights, pairs=pairs)

    # ---- estimates
    def speed(self, util_a: float, util_b: float) -> float:
        """Estimated speed (0..1 of alone) of a job with solo utilisation util_a next to one of util_b."""
        ua = 0.0 if util_a < 0.0 else 1.0 if util_a > 1.0 else util_a
        ub = 0.0 if util_b < 0.0 else 1.0 if util_b > 1.0 else util_b
        w0, w1, w2, w3, w4, w5 = self._w
        over = ua + ub - 1.0
        s = w0 + w1 * ua + w2 * ub + w3 * ua * ub
        if over > 0.0:
            s += w4 * over + w5 * over * over
        return 1.0 if s > 1.0 else MIN_SPEED if s < MIN_SPEED else s

    def speed_array(self, util_a: np.ndarray, util_b: np.ndarray) -> np.ndarray:
        """`speed` for whole arrays at once (the policies score a fleet this way)."""
        ua = np.clip(np.asarray(util_a, dtype=np.float64), 0.0, 1.0)
        ub = np.clip(np.asarray(util_b, dtype=np.float64), 0.0, 1.0)
        return _speed(self.weights, *np.broadcast_arrays(ua, ub))

    def measured(self, model_a: str, model_b: str, util_a: float | None = None,
                 util_b: float | None = None) -> tuple[float, float] | None:
        """Measured (speed_a, speed_b) of two named models together, or None if that pair was never measured.

        Several batch sizes / precisions of a pair were measured: with utilisations given, the measurement whose
        solo utilisations are nearest; otherwise the mean.
        """
        if self.pairs is None:
            return None
        index = _pair_index(self)
        rows = index.get((model_a, model_b))
        if rows is None:
            return None
        if util_a is None or util_b is None:
            sa, sb = rows.speed.mean(), rows.speed_b.mean()
        else:
            dist = (rows.ua.to_numpy() - util_a) ** 2 + (rows.ub.to_numpy() - util_b) ** 2
            k = int(np.argmin(dist))
            sa, sb = rows.speed.iloc[k], rows.speed_b.iloc[k]
        return min(1.0, max(MIN_SPEED, float(sa))), min(1.0, max(MIN_SPEED, float(sb)))

    def slowdown(self, util_a: float, util_b: float, models: tuple[str, str] | None = None) -> tuple[float, float]:
        """(slowdown_a, slowdown_b) >= 1 of two jobs sharing a device: measured when `models` names a measured
        pair, else estimated from the solo utilisations."""
        if models is not None:
            got = self.measured(models[0], models[1], util_a, util_b)
            if got is not None:
                return 1.0 / got[0], 1.0 / got[1]
        return 1.0 / self.speed(util_a, util_b), 1.0 / self.speed(util_b, util_a)

    def slowdowns(self, utils: list[float]) -> list[float]:
        """Slowdown of each of several jobs running side by side: each against the others' summed utilisation."""
        total = sum(_clip01(u) for u in utils)
        return [1.0 / self.speed(u, min(1.0, total - _clip01(u))) for u in utils]


def _clip01(x: float) -> float:
    return 0.0 if x < 0.0 else 1.0 if x > 1.0 else float(x)


# the last pairs table indexed, and its index: the table itself is kept (and compared by identity), because an id
# alone is reused by the next table once the first is freed, which would then read the first table's speeds
_PAIR_INDEX: list[tuple[pd.DataFrame, dict[tuple[str, str], pd.DataFrame]]] = []


def _pair_index(model: InterferenceModel) -> dict[tuple[str, str], pd.DataFrame]:
    if _PAIR_INDEX and _PAIR_INDEX[0][0] is model.pairs:
        return _PAIR_INDEX[0][1]
    index = {k: g.reset_index(drop=True) for k, g in model.pairs.groupby(["model_a", "model_b"], sort=False)}
    _PAIR_INDEX[:] = [(model.pairs, index)]
    return index


def _read(path: Path, columns: tuple[str, ...]) -> pd.DataFrame:
    if not path.is_file():
        raise InvalidInput(f"co-location data {path} does not exist; point to the folder holding {path.name}")
    frame = pd.read_csv(path)
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise InvalidInput(f"{path} lacks columns {missing}; expected {list(columns)}, found {list(frame.columns)}")
    return frame


def load_pairs(data_dir: Path) -> pd.DataFrame:
    """Every measured (job, neighbour) speed with both jobs' solo utilisations (0..1): one row per side of a pair.

    Rows whose models are not in the single-job file, or whose numbers are missing, are dropped.
    """
    data_dir = Path(data_dir)
    coloc = _read(data_dir / COLOCATE_FILE, COLOCATE_COLUMNS)
    single = _read(data_dir / SINGLE_FILE, SINGLE_COLUMNS)
    key = ["model", "batchsize", "amp"]
    solo = single.drop_duplicates(key).set_index(key)["gpu_util"] / 100.0
    k1 = pd.MultiIndex.from_frame(coloc[["model1", "batchsize1", "amp1"]].set_axis(key, axis=1))
    k2 = pd.MultiIndex.from_frame(coloc[["model2", "batchsize2", "amp2"]].set_axis(key, axis=1))
    u1 = solo.reindex(k1).to_numpy()
    u2 = solo.reindex(k2).to_numpy()
    pair_id = np.arange(len(coloc))
    sides = pd.DataFrame({
        "pair": np.r_[pair_id, pair_id],
        "model_a": np.r_[coloc.model1.to_numpy(), coloc.model2.to_numpy()],
        "model_b": np.r_[coloc.model2.to_numpy(), coloc.model1.to_numpy()],
        "ua": np.r_[u1, u2],
        "ub": np.r_[u2, u1],
        "speed": np.r_[coloc.speed1.to_numpy(), coloc.speed2.to_numpy()],
        "speed_b": np.r_[coloc.speed2.to_numpy(), coloc.speed1.to_numpy()],  # the neighbour's, same measurement
    })
    sides = sides.dropna()
    return sides.sort_values(["pair", "model_a"], kind="stable").reset_index(drop=True)


def holdout_error(data_dir: Path, folds: int = 5, seed: int = 0) -> dict[str, float]:
    """How well utilisation predicts co-located speed for model pairs the fit never saw.

    Model pairs (unordered) are split into `folds` groups; each group is predicted by a fit on the others.
    Returns MAE and RMSE of the speed, the MAE of a constant (mean speed) predictor as an anchor, the MAE of the
    slowdown, and the counts.
    """
    pairs = load_pairs(data_dir)
    unordered = pairs.apply(lambda r: "|".join(sorted((r.model_a, r.model_b))), axis=1).to_numpy()
    names = np.unique(unordered)
    rng = np.random.default_rng(seed)
    fold_of = dict(zip(names, rng.permutation(len(names)) % folds, strict=True))
    fold = np.array([fold_of[n] for n in unordered])
    ua, ub, speed = pairs.ua.to_numpy(), pairs.ub.to_numpy(), pairs.speed.to_numpy()
    pred = np.empty_like(speed)
    base = np.empty_like(speed)
    for f in range(folds):
        test = fold == f
        if not test.any():
            continue
        weights = _fit(ua[~test], ub[~test], speed[~test])
        pred[test] = _speed(weights, ua[test], ub[test])
        base[test] = np.clip(speed[~test].mean(), MIN_SPEED, 1.0)
    err = pred - speed
    true_slow = 1.0 / np.clip(speed, MIN_SPEED, None)
    return {
        "mae": float(np.abs(err).mean()),
        "rmse": float(np.sqrt((err ** 2).mean())),
        "baseline_mae": float(np.abs(base - speed).mean()),
        "slowdown_mae": float(np.abs(1.0 / pred - true_slow).mean()),
        "n_measurements": int(len(speed)),
        "n_model_pairs": int(len(names)),
        "folds": folds,
    }


@lru_cache(maxsize=4)
def _cached_model(data_dir: str | None) -> InterferenceModel:
    return InterferenceModel() if data_dir is None else InterferenceModel.from_csv(Path(data_dir))


def default_model(data_dir: Path | None = None) -> InterferenceModel:
    """The model fitted on `data_dir` (cached), or the built-in fitted weights without the measured lookup."""
    return _cached_model(None if data_dir is None else str(data_dir))


def slowdown(util_a: float, util_b: float, models: tuple[str, str] | None = None,
             model: InterferenceModel | None = None) -> tuple[float, float]:
    """Module-level shortcut for `InterferenceModel.slowdown` on the default (or given) model."""
    return (model or default_model()).slowdown(util_a, util_b, models)
