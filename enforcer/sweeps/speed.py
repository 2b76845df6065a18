"""How fast a trial runs at a width: data-parallel above 1, sharing a GPU in lanes below 1 (Lucid-measured).

A width w >= 1 is w whole GPUs running the trial data-parallel; its speed is 1 at w = 1 and w * eta above (eta: the
stated data-parallel efficiency). A width 1/k (k >= 2) puts k trials on one GPU, each in its own Salus lane; each
runs at `share_speeds[k]` of its speed alone. For k = 2 that is the Lucid pair measured for the sweep's model (two
copies of one model on one GPU), for more the interference model's estimate from the model's solo utilisation. How
many lanes one GPU can open for the sweep's trials is Salus's admission rule (`enforcer.lanes`), so the largest k is
min(c, what the memory admits).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from enforcer.interference import SINGLE_FILE, InterferenceModel
from enforcer.lanes import DeviceLanes, Job
from store.errors import InvalidInput

MIB = 1 << 20


@dataclass(frozen=True)
class SpeedModel:
    """Per-trial speed (relative to alone on one GPU) at each width the allocator may give."""

    dp_efficiency: float = 0.85
    share_speeds: tuple[float, ...] = (1.0, 0.65)  # [k - 1]: each trial's speed when k trials share one GPU
    max_span: int = 4  # d: most GPUs one trial spans

    def __post_init__(self) -> None:
        if not 0.0 < self.dp_efficiency <= 1.0:
            raise InvalidInput(f"data-parallel efficiency {self.dp_efficiency} must be in (0, 1]")
        if self.max_span < 1:
            raise InvalidInput(f"d (most GPUs per trial) is {self.max_span}; it must be at least 1")
        if not self.share_speeds or any(not 0.0 < s <= 1.0 for s in self.share_speeds):
            raise InvalidInput(f"share speeds {self.share_speeds} must each be in (0, 1]")

    @property
    def max_share(self) -> int:
        """c as the memory allows: the most trials on one GPU."""
        return len(self.share_speeds)

    def levels(self) -> list[float]:
        """Every width a trial may get, smallest first: the shares 1/k (k = c down to 2) that keep k the most trials on
        their GPU, then 1 .. d. Ray puts a fractional bundle on any GPU it fits (NodeResourceInstanceSet::TryAllocate),
        so a 1/k share may meet any others: beside shares of at least 1/c it has at most 1 + floor((1 - 1/k) c) trials
        on its GPU, at most k when (k - 1) c < k^2. So c <= 3 keeps every share from 1/c to 1/2; a larger c only 1/c
        and 1/(c - 1), and no share runs slower than `speed` says."""
        c = self.max_share
        shares = [1.0 / k for k in range(c, 1, -1) if (k - 1) * c < k * k]
        return shares + [float(w) for w in range(1, self.max_span + 1)]

    def speed(self, width: float) -> float:
        if width <= 0.0:
            return 0.0
        if width >= 1.0 - 1e-9:
            w = round(width)
            return 1.0 if w == 1 else w * self.dp_efficiency
        k = round(1.0 / width)
        return self.share_speeds[min(k, self.max_share) - 1]


def gpu_cost(widths: list[float]) -> int:
    """Whole GPUs a set of widths takes: each w >= 1 its w GPUs, the trials of width 1/k k to a GPU."""
    whole = 0
    shared: dict[int, int] = {}
    for w in widths:
        if w <= 0.0:
            continue
        if w >= 1.0 - 1e-9:
            whole += round(w)
        else:
            k = round(1.0 / w)
            shared[k] = shared.get(k, 0) + 1
    return whole + sum(math.ceil(n / k) for k, n in shared.items())


def lanes_admitted(persistent: int, ephemeral: int, capacity: int, limit: int) -> int:
    """How many trials of (P, E) bytes one empty GPU of `capacity` takes, each in a lane of its own (up to limit)."""
    device = DeviceLanes(0, capacity)
    n = 0
    while n < limit:
        # context 0: Lucid's gmem is what nvidia-smi showed of the trial, its CUDA context included
        adm = device.admit(Job(f"t{n}", persistent=persistent, ephemeral=ephemeral, context=0))
        if adm is None or not adm.new_lane:
            break
        device.bind(adm)
        n += 1
    return max(1, n)


def from_lucid(data_dir: Path, model: str, batch_size: int, *, max_share: int = 2, max_span: int = 4,
               dp_efficiency: float = 0.85, capacity: int = 16 << 30,
               interference: InterferenceModel | None = None) -> SpeedModel:
    """The speed model of a sweep whose trials train `model` at `batch_size` (a row of the Lucid single-job data).

    The trial's memory alone (Lucid's gmem, charged as persistent) decides how many lanes a GPU of `capacity` opens;
    two sharers run at the measured pair speed of the model with itself, more at the interference estimate.
    """
    if max_share < 1:
        raise InvalidInput(f"c (most trials per GPU) is {max_share}; it must be at least 1")
    path = Path(data_dir) / SINGLE_FILE
    if not path.is_file():
        raise InvalidInput(f"{path} does not exist; point to the folder holding the Lucid data")
    single = pd.read_csv(path)
    rows = single[(single.model == model) & (single.batchsize == batch_size) & (single.amp == 0)]
    if rows.empty:
        raise InvalidInput(f"the Lucid data has no {model} at batch size {batch_size}; models: "
                           f"{', '.join(sorted(single.model.unique()))}")
    util = float(rows.gpu_util.iloc[0]) / 100.0
    memory = int(float(rows.gmem.iloc[0]) * MIB)
    if memory > capacity:
        # data-parallel copies hold the whole model on each GPU: no width runs it, and one lane "alone" would hide it
        raise InvalidInput(f"{model} at batch size {batch_size} takes {memory / 2**30:.1f} GiB, more than a GPU of "
                           f"{capacity / 2**30:.1f} GiB: give the capacity of the sweep's GPUs or a smaller batch")
    k_max = min(max_share, lanes_admitted(memory, 0, capacity, max_share))
    model_ = interference if interference is not None else InterferenceModel.from_csv(Path(data_dir))
    speeds = [1.0]
    for k in range(2, k_max + 1):
        measured = model_.measured(model, model, util, util) if k == 2 else None
        speeds.append(min(measured) if measured else model_.slowdowns([util] * k)[0] ** -1)
    return SpeedModel(dp_efficiency=dp_efficiency, share_speeds=tuple(speeds), max_span=max_span)
