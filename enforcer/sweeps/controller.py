"""The Fluid allocator behind an engine that changes a trial's resources only when that trial reports (Ray Tune).

Ray Tune calls the allocation function of a trial only on that trial's result, and only when the base scheduler
lets it continue; GPUs freed by a stop reach the others at their next result. So the controller keeps every trial's
state, re-plans with `enforcer.sweeps.fluid.plan` on each event, and hands a trial its planned width when it next
reports: a shrink at once, a growth only once the GPUs it needs are free (else it waits for a later result). Every
width it hands out is logged as a `Reallocation`, in order. The live scheduler (collector.tune) and the simulator's
model of Ray Tune (enforcer.sim.sweeps.tune_model) drive this one class, so both make the same decisions.

The engine, not the controller, says what a trial runs at: at every result (`running`: its placement group's GPUs
and, when the trial reports them, which GPUs those are) and when it retries a trial that died (`retried`: Ray Tune
keeps a resized trial's placement group on a retry). The controller follows it.

Free GPUs are counted as Ray places bundles, not as `speed.gpu_cost` packs them: a whole-GPU bundle takes whole
GPUs that hold nothing else, and a fractional bundle stays on the one GPU Ray put it on until it ends, whatever
leaves that GPU meanwhile. So a share counts once per GPU its trial reported at its current width (shares reported on
one GPU count that GPU once), and a share not reported yet counts as a GPU of its own. A growth to w GPUs is handed
out only when w GPUs hold nothing (a growth to a share: one GPU), after the others and the profiling steps the plan
starts (one GPU each): never a width Ray cannot place beside what it holds.

The engine also starts trials between results, on its own (Ray Tune: a PENDING trial's placement group is requested as
soon as Ray has the trial, and it starts when it fits) or when it asks (Ray Tune asks the scheduler which paused trial
to resume; a trial the engine paused at the end of its round, `paused`, holds nothing until then). Such a trial is
counted at the width it starts with from the moment the engine says so (`pending`, `may_start`) until its first
result, before any growth is handed out; and while a growth handed out is not placed yet (`promised`, until
`growth_placed`, the trial's next result, or its end), a trial the engine asks about waits (`may_start` says no) if it
would take GPUs that growth was promised, unless the engine runs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from enforcer.sweeps.fluid import Decision, FluidConfig, Kind, TrialState, check_steps, check_width, plan
from store.errors import InvalidInput


def gpus_for(width: float) -> int:
    """The GPUs a placement group of `width` takes that held nothing before: whole GPUs, or one for a share."""
    return round(width) if width >= 1.0 - 1e-9 else 1


@dataclass(frozen=True)
class Event:
    """What the sweep's records keep (store.sweeps): start, resize, keep (held back, and why), wait (not started,
    and why), finish, died."""

    kind: str
    trial_id: str
    old_width: float
    new_width: float
    reason: str = ""
    steps_left: float | None = None
    at: float = 0.0


@dataclass(frozen=True)
class Reallocation:
    seq: int
    trial_id: str
    old_width: float
    new_width: float
    kind: str
    reason: str
    at: float = 0.0


class SweepController:
    def __init__(self, config: FluidConfig, base_width: float = 1.0) -> None:
        self.config = config
        self.base_width = base_width
        self.trials: dict[str, TrialState] = {}
        self.planned: dict[str, Decision] = {}
        self.log: list[Reallocation] = []
        self.notes: list[tuple[str, str]] = []  # (trial, reason) of decisions that held a trial back
        self.events: list[Event] = []
        self.placed: dict[str, tuple[float, frozenset[str]]] = {}  # trial -> (width, the GPUs it reported there)
        self.starting: dict[str, float] = {}  # trial -> width the engine starts it at, until its first result
        self.promised: dict[str, float] = {}  # trial -> the width of a growth handed out and not placed yet
        self._now = 0.0
        self._released = 0  # trials added so far: the next one's release order

    # ---- events
    def add(self, trial_id: str, group: str, steps: float) -> None:
        if trial_id in self.trials:
            raise InvalidInput(f"trial {trial_id!r} was added twice")
        check_steps(trial_id, steps)
        # release order counts every trial ever added: the count of trials held now would give a trial added after
        # one ended the order of one still waiting, and the id, not the release, would decide between them
        self.trials[trial_id] = TrialState(trial_id, group, steps, None, 0.0, True, self._released)
        self._released += 1

    def started(self, trial_id: str, width: float | None = None) -> None:
        """The engine started (or restarted) the trial with `width` (default: the base width every trial starts at)."""
        t = self._get(trial_id)
        self.trials[trial_id] = replace(t, width=self.base_width if width is None else width)

    def pending(self, trial_id: str, width: float) -> None:
        """The engine will start the trial at `width` as soon as that fits, whatever the controller says (Ray Tune
        requests a PENDING trial's placement group itself): counted at that width until its first result."""
        check_width(trial_id, width)
        t = self.trials.get(trial_id)
        if t is not None and not t.running:
            self.starting[trial_id] = width

    def may_start(self, trial_id: str, width: float, *, idle: bool = False) -> bool:
        """The engine asks whether to start or resume the trial at `width` now. No while a growth handed out to another
        trial is not placed yet and this one would put the GPUs counted over the sweep's (it would take GPUs the growth
        was promised), unless the engine runs nothing (`idle`: something must start). Yes otherwise, and it is counted
        at that width from now."""
        check_width(trial_id, width)
        if self.trials.get(trial_id) is None:
            return True  # not this sweep's to hold back
        waits_for_growth = any(tid != trial_id for tid in self.promised)
        if waits_for_growth and not idle and self.held(trial_id) + gpus_for(width) > self.config.gpus:
            return False
        self.pending(trial_id, width)
        return True

    def growth_placed(self, trial_id: str) -> None:
        """The engine placed the growth it was handed (Ray Tune: the trial runs again, on its new placement group)."""
        self.promised.pop(trial_id, None)

    def retried(self, trial_id: str, group: str, width: float, *, now: float = 0.0) -> None:
        """The engine retries a trial that died, from its last checkpoint, at `width`: the placement group it last held
        or was being resized to (Ray Tune keeps it on a retry, it does not go back to the base width). It holds those
        GPUs from now (it waits for them, then runs) and is planned again from its next result."""
        check_width(trial_id, width)
        self._now = now
        self.add(trial_id, group, 0.0)
        self.trials[trial_id] = replace(self.trials[trial_id], width=width)
        self.events.append(Event("start", trial_id, 0.0, width, "came back after it died", None, now))
        self._replan()

    def paused(self, trial_id: str, reason: str, steps_left: float | None = None, *, now: float = 0.0) -> None:
        """The engine paused the trial at the end of its round (Ray Tune: HyperBand at its rung, until the rung
        decides): its GPUs go back to the sweep (Ray frees its placement group), and it waits with no steps left until
        the engine resumes it (`may_start`, `pending`) for a round whose steps it reports then (`steps_left`: what it
        reported at the pause, for the record). A pause to resize is not this: the trial keeps the width it was
        handed."""
        if steps_left is not None:
            check_steps(trial_id, steps_left)
        self._now = now
        t = self.trials.get(trial_id)
        if t is None or not t.running:
            return
        self.events.append(Event("wait", trial_id, t.width, 0.0, reason,
                                 t.remaining_steps if steps_left is None else steps_left, now))
        self.trials[trial_id] = replace(t, width=0.0, remaining_steps=0.0)
        self.placed.pop(trial_id, None)
        self.starting.pop(trial_id, None)
        self.promised.pop(trial_id, None)
        self._replan()

    def running(self, trial_id: str, width: float, gpus: list[str] | None = None, *, now: float = 0.0) -> None:
        """The engine reports a result of the trial: it runs at `width` (Ray: its placement group's GPUs), on `gpus`
        when the trial reports them (ids unique across the cluster: node and GPU). The controller follows the engine;
        a width it did not hand out is recorded as a resize with the reason."""
        check_width(trial_id, width)
        self._now = now
        back = trial_id not in self.trials
        if back:  # back after a failure without the engine saying so: planned again from here
            self.add(trial_id, trial_id, 0.0)
        t = self.trials[trial_id]
        if t.width <= 0:
            reason = "came back after it died" if back else "resumed" if t.step_s is not None else ""
            self.events.append(Event("start", trial_id, 0.0, width, reason, t.remaining_steps, now))
        elif abs(t.width - width) > 1e-9:
            self.events.append(Event("resize", trial_id, t.width, width, f"the engine runs it at {width:g} GPUs",
                                     t.remaining_steps, now))
        self.trials[trial_id] = replace(t, width=width)
        self.starting.pop(trial_id, None)
        self.promised.pop(trial_id, None)  # it runs: its growth is placed, or the engine runs it at another width
        if gpus:
            self.placed[trial_id] = (width, frozenset(gpus))
        else:
            self.placed.pop(trial_id, None)

    def on_result(self, trial_id: str, step_s: float | None, steps_left: float, *, checkpointed: bool = True,
                  now: float = 0.0) -> float:
        """A result of a running trial: its measured seconds per step alone (None: not reported) and steps left.
        Returns the width it should run at from now (its current one when nothing changes). Without `running` first,
        a trial's first result finds it at the base width."""
        check_steps(trial_id, steps_left)  # before anything changes: NaN or a negative count would read as none left
        self._now = now
        back = trial_id not in self.trials
        if back:  # back after a failure (the engine retried it): planned again from here
            self.add(trial_id, trial_id, steps_left)
        t = self._get(trial_id)
        if t.width <= 0:  # its first result: the engine started it without telling
            self.starting.pop(trial_id, None)
            t = replace(t, width=self.base_width)
            self.events.append(Event("start", trial_id, 0.0, self.base_width,
                                     "came back after it died" if back else "", steps_left, now))
        self.trials[trial_id] = replace(t, step_s=step_s if step_s is not None else t.step_s,
                                        remaining_steps=max(0.0, steps_left), checkpointed=checkpointed)
        self._replan()
        return self._hand_out(trial_id, now)

    def finished(self, trial_id: str, reason: str = "", *, died: bool = False, now: float | None = None) -> None:
        """The trial completed, stopped or died: its GPUs go back (to the others at their next result)."""
        if now is not None:
            self._now = now
        t = self.trials.pop(trial_id, None)
        if t is not None:
            self.events.append(Event("died" if died else "finish", trial_id, t.width, 0.0, reason, t.remaining_steps,
                                     self._now))
        self.planned.pop(trial_id, None)
        self.placed.pop(trial_id, None)
        self.starting.pop(trial_id, None)
        self.promised.pop(trial_id, None)  # given up
        self._replan()

    # ---- reading
    def width(self, trial_id: str) -> float:
        return self._get(trial_id).width

    def held(self, but: str = "") -> int:
        """GPUs that hold something, as Ray places bundles (the module's doc), for the running trials other than
        `but`, the trials the engine is starting, and one GPU for each other profiling step the plan starts."""
        whole, loose = 0, 0
        shared: set[str] = set()
        for o in self.trials.values():
            if not o.running or o.trial_id == but:
                continue
            if o.width >= 1.0 - 1e-9:
                whole += gpus_for(o.width)
                continue
            width, gpus = self.placed.get(o.trial_id, (0.0, frozenset()))
            if gpus and abs(width - o.width) <= 1e-9:
                shared |= gpus
            else:
                loose += 1
        starting = {tid: w for tid, w in self.starting.items()
                    if tid != but and tid in self.trials and not self.trials[tid].running}
        profiles = sum(1 for d in self.planned.values()
                       if d.kind == Kind.PROFILE and d.trial_id != but and d.trial_id not in starting)
        return whole + len(shared) + loose + sum(gpus_for(w) for w in starting.values()) + profiles

    def sequence(self) -> list[tuple[str, float, float]]:
        return [(r.trial_id, r.old_width, r.new_width) for r in self.log]

    # ---- inside
    def _get(self, trial_id: str) -> TrialState:
        t = self.trials.get(trial_id)
        if t is None:
            raise InvalidInput(f"trial {trial_id!r} is not part of this sweep")
        return t

    def _replan(self) -> None:
        # the engine starts waiting trials at the base width when GPUs free up; planning them too leaves room for
        # their profiling step
        self.planned = {d.trial_id: d for d in plan(list(self.trials.values()), self.config)}
        for d in self.planned.values():
            if d.kind in (Kind.KEEP, Kind.WAIT) and (d.trial_id, d.reason) not in self.notes:
                self.notes.append((d.trial_id, d.reason))
                t = self.trials[d.trial_id]
                self.events.append(Event(str(d.kind), d.trial_id, t.width, t.width, d.reason, t.remaining_steps,
                                         self._now))

    def _hand_out(self, trial_id: str, now: float) -> float:
        t = self.trials[trial_id]
        d = self.planned.get(trial_id)
        if d is None or d.kind != Kind.RESIZE or abs(d.new_width - t.width) < 1e-9:
            return t.width
        if d.new_width > t.width:
            if self.held(trial_id) + gpus_for(d.new_width) > self.config.gpus:
                return t.width  # the GPUs it grows into are not free yet: at a later result
            self.promised[trial_id] = d.new_width  # until the engine places it
        self.log.append(Reallocation(len(self.log), trial_id, t.width, d.new_width, d.kind, d.reason, now))
        self.events.append(Event("resize", trial_id, t.width, d.new_width, d.reason, t.remaining_steps, now))
        self.trials[trial_id] = replace(t, width=d.new_width)
        return d.new_width
