"""The tuners the sweep simulator runs: which trials they release, and what each does at the end of a round.

- grid: every configuration at the full budget, released together as one group.
- identical: one configuration, many copies at the full budget, one group (more trials than GPUs).
- sha: synchronous successive halving (one HyperBand bracket): n trials at budget R/eta^k; when the whole rung is
  done the best 1/eta are promoted (paused until then, then resumed from their checkpoints), as one new group.
- hyperband: HyperBand's brackets (s = rungs-1 .. 0, n = ceil(rungs / (s + 1) * eta^s) trials at budget R / eta^s),
  all released at once, each bracket a synchronous successive halving of its own (as Ray's HyperBandScheduler);
  hyperband_seq: the same brackets one after the other (the HyperBand paper's loop).
- asha: asynchronous successive halving as Ray's ASHA: a trial reaching a rung continues if its score is at or
  above the (1 - 1/eta) quantile of the scores recorded there so far (the first always continues), else stops; a
  new trial is released whenever fewer than `concurrency` trials are unfinished.

A score is the configuration's final score plus seeded Gaussian noise that shrinks as the budget grows (the
benchmarks have no per-epoch curves), so two runs with one seed promote the same trials for the same results.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from enforcer.sim.sweeps.data import Table
from store.errors import InvalidInput

ALGORITHMS = ("grid", "sha", "asha", "identical")
# printed by benchmarks/fluid.py beside the four (with sha's target: HyperBand's brackets are each a sync SHA)
EXTRA_ALGORITHMS = ("hyperband", "hyperband_seq")


@dataclass(frozen=True)
class Release:
    trial_id: str
    group: str
    config: int
    steps: float  # epochs of this round
    resume: bool = False  # from a checkpoint (a paused trial promoted)


@dataclass
class Tuner:
    """Base: trials released once; every round ends the trial."""

    table: Table
    seed: int
    rng: np.random.Generator = field(init=False)
    noise_scale: float = field(init=False)

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)
        self.noise_scale = 0.5 * float(np.std(self.table.score))

    def start(self) -> list[Release]:
        raise NotImplementedError

    def round_done(self, trial_id: str, unfinished: int) -> tuple[float | None, list[Release]]:
        """(epochs to continue the trial with, or None: it stops or pauses), and trials released now."""
        return None, []

    def score(self, trial_id: str, config: int, budget: float) -> float:
        """Final score plus noise seeded by (seed, trial, budget): the same in every run of one seed."""
        frac = min(1.0, budget / self.table.epochs)
        noise = np.random.default_rng([self.seed, int(trial_id.rsplit("-", 1)[-1]), int(budget * 1000)]).normal()
        return float(self.table.score[config]) + self.noise_scale * (1.0 - frac) ** 0.5 * noise


@dataclass
class Grid(Tuner):
    n: int = 24

    def start(self) -> list[Release]:
        configs = self.rng.choice(len(self.table), size=self.n, replace=False)
        return [Release(f"t-{i}", "grid", int(c), float(self.table.epochs)) for i, c in enumerate(configs)]


@dataclass
class Identical(Tuner):
    n: int = 12

    def start(self) -> list[Release]:
        config = int(self.rng.integers(len(self.table)))
        return [Release(f"t-{i}", "identical", config, float(self.table.epochs)) for i in range(self.n)]


@dataclass
class SyncSha(Tuner):
    n: int = 81
    eta: int = 3
    rungs: int = 5
    _config: dict[str, int] = field(default_factory=dict)
    _rung: int = 0
    _members: list[str] = field(default_factory=list)
    _done: dict[str, float] = field(default_factory=dict)

    def budget(self, rung: int) -> float:
        return self.table.epochs / self.eta ** (self.rungs - 1 - rung)

    def start(self) -> list[Release]:
        configs = self.rng.choice(len(self.table), size=self.n, replace=False)
        self._members = [f"t-{i}" for i in range(self.n)]
        self._config = {t: int(c) for t, c in zip(self._members, configs, strict=True)}
        return [Release(t, "rung-0", self._config[t], self.budget(0)) for t in self._members]

    def round_done(self, trial_id: str, unfinished: int) -> tuple[float | None, list[Release]]:
        self._done[trial_id] = self.score(trial_id, self._config[trial_id], self.budget(self._rung))
        if len(self._done) < len(self._members) or self._rung + 1 >= self.rungs:
            return None, []
        keep = max(1, len(self._members) // self.eta)
        best = sorted(self._members, key=lambda t: (-self._done[t], t))[:keep]
        self._rung += 1
        self._members, self._done = best, {}
        steps = self.budget(self._rung) - self.budget(self._rung - 1)
        return None, [Release(t, f"rung-{self._rung}", self._config[t], steps, resume=True) for t in best]


@dataclass
class Asha(Tuner):
    n: int = 81
    eta: int = 3
    rungs: int = 5
    concurrency: int = 8
    _released: int = 0
    _config: dict[str, int] = field(default_factory=dict)
    _rung: dict[str, int] = field(default_factory=dict)
    _recorded: dict[int, list[float]] = field(default_factory=dict)
    _configs: np.ndarray | None = None

    def budget(self, rung: int) -> float:
        return self.table.epochs / self.eta ** (self.rungs - 1 - rung)

    def _new(self) -> Release:
        if self._configs is None:
            self._configs = self.rng.choice(len(self.table), size=self.n, replace=False)
        i = self._released
        self._released += 1
        tid = f"t-{i}"
        self._config[tid], self._rung[tid] = int(self._configs[i]), 0
        return Release(tid, tid, self._config[tid], self.budget(0))

    def start(self) -> list[Release]:
        return [self._new() for _ in range(min(self.n, self.concurrency))]

    def round_done(self, trial_id: str, unfinished: int) -> tuple[float | None, list[Release]]:
        rung = self._rung[trial_id]
        go_on = None
        if rung + 1 < self.rungs:
            s = self.score(trial_id, self._config[trial_id], self.budget(rung))
            seen = self._recorded.setdefault(rung, [])
            cutoff = float(np.percentile(seen, (1 - 1 / self.eta) * 100)) if seen else None
            seen.append(s)
            if cutoff is None or s >= cutoff:
                self._rung[trial_id] = rung + 1
                go_on = self.budget(rung + 1) - self.budget(rung)
        left = unfinished - (0 if go_on is not None else 1)
        released = [self._new() for _ in range(max(0, min(self.n - self._released, self.concurrency - left)))]
        return go_on, released


@dataclass
class HyperBand(Tuner):
    eta: int = 3
    rungs: int = 5
    sequential: bool = False  # True: one bracket after the other (the HyperBand paper's loop), not all at once
    _brackets: list[SyncSha] = field(default_factory=list)
    _bracket_of: dict[str, SyncSha] = field(default_factory=dict)
    _held: list[list[Release]] = field(default_factory=list)
    _left: dict[int, int] = field(default_factory=dict)

    def start(self) -> list[Release]:
        releases = self._all()
        if not self.sequential:
            return [r for rs in releases for r in rs]
        self._held = releases[1:]
        return releases[0]

    def _all(self) -> list[list[Release]]:
        configs = iter(self.rng.permutation(len(self.table)))
        releases: list[list[Release]] = []
        first = 0
        for s in range(self.rungs - 1, -1, -1):
            n = int(np.ceil(self.rungs / (s + 1) * self.eta ** s))
            bracket = SyncSha(self.table, self.seed, n=n, eta=self.eta, rungs=s + 1)
            bracket.budget = lambda rung, s=s: self.table.epochs / self.eta ** (s - rung)  # type: ignore[method-assign]
            bracket._members = [f"t-{first + i}" for i in range(n)]
            bracket._config = {t: int(next(configs)) for t in bracket._members}
            for t in bracket._members:
                self._bracket_of[t] = bracket
            releases.append([Release(t, f"b{s}-rung-0", bracket._config[t], bracket.budget(0))
                             for t in bracket._members])
            self._brackets.append(bracket)
            first += n
        return releases

    def round_done(self, trial_id: str, unfinished: int) -> tuple[float | None, list[Release]]:
        bracket = self._bracket_of[trial_id]
        last_rung = bracket._rung + 1 >= bracket.rungs
        go_on, released = bracket.round_done(trial_id, unfinished)
        tag = f"b{bracket.rungs - 1}-"
        out = [Release(r.trial_id, tag + r.group, r.config, r.steps, r.resume) for r in released]
        if self.sequential and last_rung and len(bracket._done) == len(bracket._members) and self._held:
            out += self._held.pop(0)  # this bracket is done: the next one starts
        return go_on, out


def make_tuner(algorithm: str, table: Table, seed: int, gpus: int = 8) -> Tuner:
    if algorithm == "grid":
        return Grid(table, seed)
    if algorithm == "identical":
        return Identical(table, seed)
    if algorithm == "sha":
        return SyncSha(table, seed)
    if algorithm == "asha":
        return Asha(table, seed, concurrency=gpus)
    if algorithm == "hyperband":
        return HyperBand(table, seed)
    if algorithm == "hyperband_seq":
        return HyperBand(table, seed, sequential=True)
    raise InvalidInput(f"unknown sweep algorithm {algorithm!r}; known: {', '.join(ALGORITHMS)}")
