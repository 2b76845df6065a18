"""The job side of a lane turn's end: wait for the step's device work while keeping the turn's lease, then give
the turn's memory back before the turn passes on.

A step's kernels may run long after the Python step returned. `LeaseKeeper.wait` runs the step's waiter (the CUDA
event's synchronize) on the calling thread and, every `every_s` it is still pending, renews the turn's lease from a
helper thread (over a connection of its own), so the gate never hands the turn on under running kernels.

`CudaStepWaiter` records its event on the current stream and blocks until it has completed. `TurnMemory` is the
lane's memory rule on the job's side: outside its turn a job is capped at its persistent share, during its turn at
persistent + ephemeral; at the turn's end PyTorch's cached blocks are released (`torch.cuda.empty_cache()`), so
lane-mates together never hold more than the lane (ΣP' + max E), which per-job caps of P' + E each would not
ensure.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class CudaStepWaiter:
    """record() an event on the current stream after the step's last kernel was queued; synchronize() blocks
    (without spinning: a blocking event) until the device has run it. Calling it does both."""

    def __init__(self, torch: Any) -> None:
        self._event = torch.cuda.Event(blocking=True)

    def record(self) -> None:
        self._event.record()

    def synchronize(self) -> None:
        self._event.synchronize()

    def __call__(self) -> None:
        self.record()
        self.synchronize()


class LeaseKeeper:
    """Renews a turn's lease from a helper thread (started on first use) while the calling thread waits for the
    step's device work, so the waiter runs where it always did: on the thread whose CUDA streams the step used.
    `renew` must not share the caller's socket (the SDK gives it a connection of its own)."""

    def __init__(self, renew: Callable[[], None]) -> None:
        self._renew = renew
        self._cond = threading.Condition()
        self._waiting = False  # a wait is under way
        self._generation = 0  # bumped by each wait, so a renewal is only ever for the wait it was timed for
        self._every_s = 20.0
        self._closed = False
        self._thread: threading.Thread | None = None
        self.renewals = 0

    def wait(self, waiter: Callable[[], None], every_s: float) -> None:
        """Run `waiter` here; every `every_s` it is still running, renew from the helper thread."""
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="fleetlens-lease-keeper", daemon=True)
                self._thread.start()
            self._every_s, self._waiting = every_s, True
            self._generation += 1
            self._cond.notify_all()
        try:
            waiter()
        finally:
            with self._cond:
                self._waiting = False
                self._cond.notify_all()

    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                if not self._waiting:
                    self._cond.wait()
                    continue
                generation = self._generation
                self._cond.wait(timeout=self._every_s)
                if self._waiting and self._generation == generation and not self._closed:  # still the same wait
                    self._cond.release()
                    try:
                        self._renew()
                        self.renewals += 1
                    except Exception:  # a renewal lost is one of many: the next one, or the gate's lease, covers it
                        pass
                    finally:
                        self._cond.acquire()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


class TurnMemory:
    """A lane job's CUDA memory caps: `idle` (its persistent share) outside its turn, `turn` (persistent +
    ephemeral) during it; fractions of the device, as set_per_process_memory_fraction takes them."""

    def __init__(self, torch: Any, turn: float, idle: float | None) -> None:
        self.torch, self.turn, self.idle = torch, turn, idle
        self.releases = 0  # turns whose cached memory was given back

    def begin(self) -> None:
        if self.idle is not None:
            self.torch.cuda.set_per_process_memory_fraction(self.turn)

    def end(self) -> None:
        """The turn's device work is done: give back cached blocks, then fall to the idle cap."""
        self.torch.cuda.empty_cache()
        self.releases += 1
        if self.idle is not None:
            self.torch.cuda.set_per_process_memory_fraction(self.idle)
