"""The per-lane iteration gate (Salus's time slicing): the jobs of one lane run one training step at a time.

The host's agent hosts one `LaneGate` and hands it the SDK's `gate` messages (collector.sdk_handlers calls
`handle` from the connection's own thread, so blocking here blocks only that job). A `begin` waits until it is
the job's turn; the matching `end` chooses who takes the next step by the policy's lane discipline
(enforcer.discipline, the same rule the simulator follows): FIFO keeps the lane for the job that came first until
it is done, PACK alternates step by step, FAIR takes the least attained step time, SRTF the least remaining time
(steps left x its mean step time; a job that declared its steps takes one step first, to be measured).

The next holder is chosen at `end`, with the releasing job as a candidate that asks now, so the outcome does not
depend on which thread wins a race. A releasing job that keeps the turn has `reserve_s` to ask again (it may be
done, or busy between steps) before the turn passes on. A holder that neither ends its step nor asks again within
its lease (it died mid-step) loses the turn, so a crashed job never blocks its lane for good. A job whose process
ended while it waited for a turn (`release`) never gets it: its handler thread, still blocked in `begin`, gives up.

A long step must not lose its turn while its kernels still run, or its lane-mate's would run beside them. So the
lease is never shorter than `LEASE_STEPS` times the holder's longest step so far (at least `lease_s`), and a holder
renews it (`renew`, which the SDK sends while it waits for its step's CUDA event) as often as it likes. A job that
leaves the loop mid-step sends `end` with `again` false: the turn passes on at once.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from enforcer.discipline import Turn, next_turn
from enforcer.policies import Policy, get_policy

Key = tuple[str, int, int]  # (workflow, pid, rank)


class LeftLane(Exception):
    """The job left the lane (its process ended, or it said bye) while a request of it waited for a turn."""

LEASE_STEPS = 3.0  # a holder's lease is at least this many of its longest step so far


@dataclass
class _JobStats:
    attained_s: float = 0.0
    steps: int = 0
    mean_step_s: float | None = None
    longest_s: float = 0.0  # its longest step so far: the lease never runs out before a step that long ends
    step: int = 0
    total_steps: int | None = None
    arrival: float = 0.0  # when it first asked (job order)


@dataclass
class _LaneState:
    cond: threading.Condition = field(default_factory=threading.Condition)
    holder: Key | None = None
    granted_at: float = 0.0
    renewed_at: float = 0.0  # the holder's last renewal (its lease runs from the later of this and granted_at)
    reserved_until: float | None = None  # the holder kept the turn at the end of its step and has not asked yet
    waiting: dict[Key, Turn] = field(default_factory=dict)
    turns: int = 0


class LaneGate:
    """One step per lane at a time, in the policy's order. Thread-safe; `handle` speaks the SDK's gate message."""

    def __init__(self, policy: Policy | str = "fifo", *, total_steps: Callable[[str], int | None] | None = None,
                 lease_s: float = 60.0, reserve_s: float = 1.0) -> None:
        self.policy = get_policy(policy) if isinstance(policy, str) else policy
        self.kind = self.policy.lane_order
        self.lease_s = lease_s
        self.reserve_s = reserve_s
        self._total_steps = total_steps
        self._lanes: dict[str, _LaneState] = {}
        self._lanes_lock = threading.Lock()
        self._stats: dict[Key, _JobStats] = {}
        self._left: set[Key] = set()  # keys that left (bye, or their process ended) since their last `begin`
        self._seq = itertools.count()

    def _lane(self, lane: str) -> _LaneState:
        state = self._lanes.get(lane)
        if state is None:
            with self._lanes_lock:
                state = self._lanes.setdefault(lane, _LaneState())
        return state

    # ---- the SDK's message -------------------------------------------------------------------------------

    def handle(self, msg: dict[str, Any]) -> dict[str, Any]:
        lane, phase = str(msg["lane"]), msg["phase"]
        key: Key = (str(msg["workflow"]), int(msg["pid"]), int(msg.get("rank") or 0))
        step = int(msg.get("step") or 0)
        if phase == "begin":
            try:
                waited = self.begin(lane, key, step)
            except LeftLane as left:
                return {"ok": False, "granted": False, "error": str(left)}
            return {"ok": True, "granted": True, "waited_s": waited, "lease_s": self.lease_s}
        if phase == "end":
            self.end(lane, key, again=msg.get("again", True) is not False)
            return {"ok": True}
        if phase == "renew":
            return {"ok": True, "holder": self.renew(lane, key)}
        return {"ok": False, "error": f"gate phase must be begin, end or renew, not {phase!r}"}

    # ---- turn taking -------------------------------------------------------------------------------------

    def begin(self, lane: str, key: Key, step: int = 0, timeout: float | None = None) -> float:
        """Block until `key` holds `lane`'s turn; returns the seconds waited. `timeout` (tests) raises TimeoutError;
        LeftLane when the job leaves (`leave`, `release`: its process ended) while it waits."""
        state = self._lane(lane)
        start = time.monotonic()
        self._left.discard(key)  # asking now: alive
        stats = self._stats.get(key)
        if stats is None:
            stats = self._stats[key] = _JobStats(total_steps=self._lookup_total(key[0]), arrival=next(self._seq))
        stats.step = step
        with state.cond:
            if state.holder is None and not state.waiting or state.holder == key:
                self._grant(state, key)
                return 0.0
            state.waiting[key] = self._turn(key, stats)
            while state.holder != key:
                now = time.monotonic()
                if key not in state.waiting:
                    if key in self._left:  # its process ended (or said bye) while this request waited: no turn
                        raise LeftLane(f"lane {lane}: {key} left while it waited for its turn")
                    state.waiting[key] = self._turn(key, stats)
                reserve_over = state.reserved_until is not None and now > state.reserved_until
                lease_end = self._lease_end(state)
                if state.holder is None or reserve_over or now > lease_end:
                    # free, a kept turn not taken up, or the holder's lease ran out (it died mid-step): hand on
                    self._grant(state, self._pick(state))
                    if state.holder == key:
                        break
                    state.cond.notify_all()
                    continue
                if timeout is not None and now - start > timeout:
                    state.waiting.pop(key, None)
                    raise TimeoutError(f"lane {lane}: no turn for {key} within {timeout} s")
                deadline = lease_end
                if state.reserved_until is not None:
                    deadline = min(deadline, state.reserved_until)
                state.cond.wait(min(1.0, max(deadline - now, 0.0) + 1e-3))
            state.waiting.pop(key, None)
        return time.monotonic() - start

    def end(self, lane: str, key: Key, *, again: bool = True) -> None:
        """`key` finished its step: account its time and give the next step to the job the discipline picks,
        `key` itself among the candidates unless it leaves (`again` False) or has done its declared steps."""
        state = self._lane(lane)
        with state.cond:
            if state.holder != key or state.reserved_until is not None:
                return  # a late end after the lease passed on, or an end without a begin
            now = time.monotonic()
            held = now - state.granted_at
            stats = self._stats.get(key)
            if stats is not None:
                stats.attained_s += held
                stats.steps += 1
                stats.step += 1
                stats.mean_step_s = held if stats.mean_step_s is None else 0.8 * stats.mean_step_s + 0.2 * held
                stats.longest_s = max(stats.longest_s, held)
                if stats.total_steps is not None and stats.step >= stats.total_steps:
                    again = False
            state.holder = None
            if not state.waiting:
                return
            chosen = self._pick(state, self._turn(key, stats) if again and stats is not None else None)
            if chosen == key:
                # it keeps the turn for its next step
                state.holder, state.granted_at, state.reserved_until = key, now, now + self.reserve_s
                return
            self._grant(state, chosen)
            state.cond.notify_all()

    def renew(self, lane: str, key: Key) -> bool:
        """`key`, holding `lane`'s turn, is still at its step (waiting for its kernels): its lease starts again.
        False when it does not hold the turn (it lost it, or never had it)."""
        state = self._lane(lane)
        with state.cond:
            if state.holder != key or state.reserved_until is not None:
                return False
            state.renewed_at = time.monotonic()
            return True

    def leave(self, key: Key) -> None:
        """A job left (bye, or it died): drop it from every lane, releasing a turn it held; a request of it still
        waiting for a turn gets none (LeftLane), so a dead job's handler thread never takes its lane's turn."""
        self._left.add(key)
        for name, state in list(self._lanes.items()):
            with state.cond:
                if state.waiting.pop(key, None) is not None:
                    state.cond.notify_all()
            if state.holder == key:
                with state.cond:
                    reserved = state.reserved_until is not None
                if reserved:
                    with state.cond:
                        state.holder, state.reserved_until = None, None
                        if state.waiting:
                            self._grant(state, self._pick(state))
                        state.cond.notify_all()
                else:
                    self.end(name, key, again=False)
        self._stats.pop(key, None)

    def release(self, workflow: str, pid: int | None = None) -> int:
        """A workflow's process was stopped or ended: forget it in every lane (a turn it held passes on now, not
        after the lease). Returns how many of its processes were known."""
        keys = [k for k in list(self._stats) if k[0] == workflow and (pid is None or k[1] == pid)]
        for state in list(self._lanes.values()):
            with state.cond:
                keys.extend(k for k in list(state.waiting) if k[0] == workflow and (pid is None or k[1] == pid)
                            and k not in keys)
                holder = state.holder
            if holder is not None and holder[0] == workflow and (pid is None or holder[1] == pid) \
                    and holder not in keys:
                keys.append(holder)
        for key in keys:
            self.leave(key)
        return len(keys)

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Per lane: who holds the turn, who waits, turns granted so far."""
        out = {}
        for name, state in list(self._lanes.items()):
            with state.cond:
                out[name] = {"holder": state.holder, "waiting": list(state.waiting), "turns": state.turns}
        return out

    def stats(self, key: Key) -> dict[str, Any]:
        s = self._stats.get(key)
        return {} if s is None else {"attained_s": s.attained_s, "steps": s.steps, "mean_step_s": s.mean_step_s}

    # ---- helpers (call with the lane's condition held) ---------------------------------------------------

    def _lease_end(self, state: _LaneState) -> float:
        """When the holder's lease runs out: lease_s, or LEASE_STEPS of its longest step, after its grant or its
        last renewal."""
        stats = self._stats.get(state.holder) if state.holder is not None else None
        lease = max(self.lease_s, LEASE_STEPS * stats.longest_s) if stats is not None else self.lease_s
        return max(state.granted_at, state.renewed_at) + lease

    def _grant(self, state: _LaneState, key: Key) -> None:
        state.holder, state.granted_at, state.reserved_until = key, time.monotonic(), None
        state.turns += 1
        state.waiting.pop(key, None)

    def _pick(self, state: _LaneState, releasing: Turn | None = None) -> Key:
        for key, turn in state.waiting.items():  # refresh what the order looks at
            stats = self._stats.get(key)
            if stats is not None:
                turn.attained_s = stats.attained_s
                turn.remaining_s = _remaining(stats)
                turn.probe = _probe(stats)
        candidates = list(state.waiting.values()) + ([releasing] if releasing is not None else [])
        chosen = next_turn(self.kind, candidates)
        assert chosen is not None
        return chosen.key  # type: ignore[return-value]

    def _turn(self, key: Key, stats: _JobStats) -> Turn:
        # asked is per request (round robin serves steps first come, first served); arrival is the job's
        return Turn(key, arrival=stats.arrival, asked=float(next(self._seq)), attained_s=stats.attained_s,
                    remaining_s=_remaining(stats), probe=_probe(stats))

    def _lookup_total(self, workflow: str) -> int | None:
        if self._total_steps is None:
            return None
        try:
            return self._total_steps(workflow)
        except Exception:
            return None


def _remaining(stats: _JobStats) -> float | None:
    if stats.total_steps is None or stats.mean_step_s is None:
        return None
    return max(0, stats.total_steps - stats.step) * stats.mean_step_s


def _probe(stats: _JobStats) -> bool:
    """Its steps are declared and none measured yet: its remaining time is one step away (SRTF measures it first)."""
    return stats.total_steps is not None and stats.mean_step_s is None
