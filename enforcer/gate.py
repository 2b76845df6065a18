"""The per-lane iteration gate (Salus's time slicing): the jobs of one lane run one training step at a time.

The host's agent hosts one `LaneGate` and hands it the SDK's `gate` messages (collector.sdk_handlers calls
`handle` from the connection's own thread, so blocking here blocks only that job). A `begin` waits until it is
the job's turn; the matching `end` gives the turn to the next waiting job, chosen by the policy's in-lane order:
FIFO and PACK take requests in arrival order (so jobs alternate), FAIR the job with the least attained step time,
SRTF the job with the least remaining time (steps left x its mean step time).

The turn is handed over at `end` (the next holder is chosen before the releasing job can ask again), so two busy
jobs alternate instead of one winning every race. A holder that neither ends its step nor asks again within
`lease_s` (it died mid-step) loses the turn, so a crashed job never blocks its lane for good.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from enforcer.lanes import Job
from enforcer.policies import Policy, get_policy

Key = tuple[str, int, int]  # (workflow, pid, rank)


@dataclass
class _JobStats:
    attained_s: float = 0.0
    steps: int = 0
    mean_step_s: float | None = None
    step: int = 0
    total_steps: int | None = None


@dataclass
class _LaneState:
    cond: threading.Condition = field(default_factory=threading.Condition)
    holder: Key | None = None
    granted_at: float = 0.0
    waiting: dict[Key, Job] = field(default_factory=dict)
    turns: int = 0


class LaneGate:
    """One step per lane at a time, in the policy's order. Thread-safe; `handle` speaks the SDK's gate message."""

    def __init__(self, policy: Policy | str = "fifo", *, total_steps: Callable[[str], int | None] | None = None,
                 lease_s: float = 60.0) -> None:
        self.policy = get_policy(policy) if isinstance(policy, str) else policy
        self.lease_s = lease_s
        self._total_steps = total_steps
        self._lanes: dict[str, _LaneState] = {}
        self._lanes_lock = threading.Lock()
        self._stats: dict[Key, _JobStats] = {}
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
            waited = self.begin(lane, key, step)
            return {"ok": True, "granted": True, "waited_s": waited}
        if phase == "end":
            self.end(lane, key)
            return {"ok": True}
        return {"ok": False, "error": f"gate phase must be begin or end, not {phase!r}"}

    # ---- turn taking -------------------------------------------------------------------------------------

    def begin(self, lane: str, key: Key, step: int = 0, timeout: float | None = None) -> float:
        """Block until `key` holds `lane`'s turn; returns the seconds waited. `timeout` (tests) raises TimeoutError."""
        state = self._lane(lane)
        start = time.monotonic()
        stats = self._stats.get(key)
        if stats is None:
            stats = self._stats[key] = _JobStats(total_steps=self._lookup_total(key[0]))
        stats.step = step
        with state.cond:
            if state.holder is None and not state.waiting or state.holder == key:
                self._grant(state, key)
                return 0.0
            state.waiting[key] = self._job(key, stats)
            while state.holder != key:
                now = time.monotonic()
                if key not in state.waiting:  # released meanwhile, yet still asking: it is alive after all
                    state.waiting[key] = self._job(key, stats)
                if state.holder is None or now - state.granted_at > self.lease_s:
                    # free, or the holder's lease ran out (it died mid-step): hand the turn on here
                    self._grant(state, self._pick(state))
                    if state.holder == key:
                        break
                    state.cond.notify_all()
                    continue
                if timeout is not None and now - start > timeout:
                    state.waiting.pop(key, None)
                    raise TimeoutError(f"lane {lane}: no turn for {key} within {timeout} s")
                state.cond.wait(min(1.0, self.lease_s - (now - state.granted_at) + 1e-3))
            state.waiting.pop(key, None)
        return time.monotonic() - start

    def end(self, lane: str, key: Key) -> None:
        """`key` finished its step: account its time and hand the turn to the next waiting job."""
        state = self._lane(lane)
        with state.cond:
            if state.holder != key:
                return  # a late end after the lease passed on, or an end without a begin
            held = time.monotonic() - state.granted_at
            stats = self._stats.get(key)
            if stats is not None:
                stats.attained_s += held
                stats.steps += 1
                stats.mean_step_s = held if stats.mean_step_s is None else 0.8 * stats.mean_step_s + 0.2 * held
            state.holder = None
            if state.waiting:
                self._grant(state, self._pick(state))
                state.cond.notify_all()

    def leave(self, key: Key) -> None:
        """A job left (bye, or it died): drop it from every lane, releasing a turn it held."""
        for name, state in list(self._lanes.items()):
            with state.cond:
                state.waiting.pop(key, None)
            if state.holder == key:
                self.end(name, key)
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

    def _grant(self, state: _LaneState, key: Key) -> None:
        state.holder, state.granted_at = key, time.monotonic()
        state.turns += 1
        state.waiting.pop(key, None)

    def _pick(self, state: _LaneState) -> Key:
        for key, job in state.waiting.items():  # refresh what the order looks at
            stats = self._stats.get(key)
            if stats is not None:
                job.attained_s = stats.attained_s
                job.remaining_s = _remaining(stats)
        chosen = self.policy.pick_next(state.waiting.values())
        assert chosen is not None
        return _key_of(chosen)

    def _job(self, key: Key, stats: _JobStats) -> Job:
        # arrival is per request: arrival-ordered policies then serve steps first come, first served
        return Job(f"{key[0]}\x00{key[1]}\x00{key[2]}", arrival=float(next(self._seq)), attained_s=stats.attained_s,
                   remaining_s=_remaining(stats))

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


def _key_of(job: Job) -> Key:
    workflow, pid, rank = job.job_id.split("\x00")
    return workflow, int(pid), int(rank)
