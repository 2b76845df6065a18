"""The job side of a lane turn's end: wait for the step's device work while keeping the turn's lease, then give
the turn's memory back before the turn passes on.

A step's kernels may run long after the Python step returned. `RenewingWait.wait` blocks on the step's waiter (the
CUDA event's synchronize) on a helper thread and, every `every_s` it is still pending, calls `renew` from the
calling thread (the one that owns the agent socket), so the gate never hands the turn on under running kernels.

`CudaStepWaiter` records its event on the calling thread (the current stream is per thread) and synchronizes
wherever it is called. `TurnMemory` is the lane's memory rule on the job's side: outside its turn a job is capped
at its persistent share, during its turn at persistent + ephemeral; at the turn's end PyTorch's cached blocks are
released (`torch.cuda.empty_cache()`), so lane-mates together never hold more than the lane (ΣP' + max E), which
per-job caps of P' + E each would not ensure.
"""

from __future__ import annotations

import queue
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


class RenewingWait:
    """Runs step waiters on one helper thread (started on first use) while the caller renews its turn."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def wait(self, waiter: Callable[[], None], renew: Callable[[], None], every_s: float) -> int:
        """Block until `waiter` returned (its exception re-raised here); `renew()` every `every_s` meanwhile.
        Returns how many renewals were sent."""
        record = getattr(waiter, "record", None)
        if record is not None:
            record()  # on this thread: the step's kernels were queued on this thread's current stream
            waiter = waiter.synchronize  # type: ignore[attr-defined]
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="fleetlens-step-waiter", daemon=True)
            self._thread.start()
        self._jobs.put(waiter)
        renewals = 0
        while True:
            try:
                error = self._done.get(timeout=every_s)
            except queue.Empty:
                renew()
                renewals += 1
                continue
            if error is not None:
                raise error
            return renewals

    def _run(self) -> None:
        while True:
            waiter = self._jobs.get()
            if waiter is None:
                return
            try:
                waiter()
            except BaseException as exc:  # handed to the waiting caller
                self._done.put(exc)
            else:
                self._done.put(None)

    def close(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
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
