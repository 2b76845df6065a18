"""A sweep's records in the store (SQLite and PostgreSQL): the controller's events, in order, and the GPU use."""

from __future__ import annotations

import threading

import pytest

from enforcer.sim.sweeps.tune_model import run_tune_model
from enforcer.sweeps.fluid import FluidConfig
from enforcer.sweeps.speed import SpeedModel
from store.db import Store
from store.errors import InvalidInput, NotFound
from store.sweeps import events, gpu_use, record_event, record_sweep, sweeps

SPEED = SpeedModel(dp_efficiency=0.85, share_speeds=(1.0, 0.65), max_span=4)


def record_sample_sweep(store, sweep_id: str = "s1") -> list:
    config = FluidConfig(4, SPEED, restart_s=1.0)
    ctrl = run_tune_model([("a", 2.0, 5), ("b", 1.0, 3)], config, start_s=1.0, restart_s=1.0, max_t=5)
    record_sweep(store, sweep_id, 4, {"c": 2, "d": 4, "eta": 0.85}, now=1000.0)
    for e in ctrl.events:
        record_event(store, sweep_id, e.trial_id, e.kind, e.old_width, e.new_width, reason=e.reason,
                     steps_left=e.steps_left, now=1000.0 + e.at)
    return ctrl.events


def test_events_round_trip_in_order(any_store) -> None:
    written = record_sample_sweep(any_store)
    rows = events(any_store, "s1")
    assert [(r.trial_id, r.kind, r.old_width, r.new_width) for r in rows] == [
        (e.trial_id, e.kind, e.old_width, e.new_width) for e in written]
    assert [r.seq for r in rows] == list(range(len(rows)))
    assert sweeps(any_store)[0]["settings"]["eta"] == 0.85
    use = gpu_use(rows, 4)
    assert all(held <= 4 for _, held, _ in use)
    assert max(held for _, held, _ in use) > max(one for _, _, one in use)  # Fluid used GPUs one per GPU left idle
    assert use[-1][1] == 0.0


def test_bad_records_raise_our_errors(sqlite_store) -> None:
    with pytest.raises(NotFound):
        record_event(sqlite_store, "nope", "t", "start", 0.0, 1.0)
    record_sweep(sqlite_store, "s", 4, {})
    with pytest.raises(InvalidInput):
        record_event(sqlite_store, "s", "t", "teleport", 0.0, 1.0)
    with pytest.raises(InvalidInput):
        record_sweep(sqlite_store, "", 4, {})


def test_a_trial_paused_at_its_rung_holds_no_gpus_until_it_starts_again(sqlite_store) -> None:
    """A pause is recorded as a wait from the trial's width to 0 (the scheduler's event): its GPUs go back."""
    record_sweep(sqlite_store, "s", 2, {})
    for i, (trial, kind, old, new) in enumerate([("a", "start", 0.0, 1.0), ("b", "start", 0.0, 1.0),
                                                 ("b", "wait", 1.0, 0.0), ("a", "resize", 1.0, 2.0),
                                                 ("a", "finish", 2.0, 0.0), ("b", "start", 0.0, 1.0)]):
        record_event(sqlite_store, "s", trial, kind, old, new, now=1000.0 + i)
    use = gpu_use(events(sqlite_store, "s"), 2)
    assert [(held, one) for _, held, one in use] == [(1.0, 1.0), (2.0, 2.0), (1.0, 1.0), (2.0, 1.0), (0.0, 0.0),
                                                     (1.0, 1.0)]


def test_writers_appending_to_one_sweep_at_once_number_every_event_once_in_their_order(any_store: Store) -> None:
    """Two drivers (or a driver and the CLI) record into one sweep in the same instant, each with its own Store: every
    event is stored once, the sweep's numbers are 0..N*M-1 each once, and each writer's events keep its order."""
    writers, each = 4, 15
    record_sweep(any_store, "shared", 4, {})
    barrier = threading.Barrier(writers)
    failed: list[BaseException] = []
    returned: list[int] = []

    def write(k: int) -> None:
        store = Store(any_store.url)
        try:
            for i in range(each):
                barrier.wait(timeout=60)  # every writer reads the sweep's last number in the same instant
                returned.append(record_event(store, "shared", f"t{k}", "start", 0.0, 1.0, reason=f"{k}:{i}"))
        except BaseException as exc:
            failed.append(exc)
            barrier.abort()
        finally:
            store.dispose()

    threads = [threading.Thread(target=write, args=(k,)) for k in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert failed == []
    rows = events(any_store, "shared")
    assert sorted(r.reason for r in rows) == sorted(f"{k}:{i}" for k in range(writers) for i in range(each))
    assert [r.seq for r in rows] == list(range(writers * each))
    assert sorted(returned) == list(range(writers * each))
    for k in range(writers):
        assert [r.reason for r in rows if r.trial_id == f"t{k}"] == [f"{k}:{i}" for i in range(each)]
