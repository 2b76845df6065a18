"""A move already under way when its source or target host falls silent (enforcer.move_silence): it gives up or puts
the job back as soon as the host counts as silent (store.registry.silent_hosts), not after its commands' deadlines,
and loses nothing: the job never stopped for a move that cannot finish, never runs twice, and an agent that comes
back finds no command of a move that is over. Driven through the real state machine on a fake clock, the agents
played by tests.enforcer.silent_fleet."""

from __future__ import annotations

import pytest

from enforcer.migration import drive
from store.db import Store
from tests.enforcer.silent_fleet import DST, SETTINGS, SRC, T0, SilentFleet

FIRST_CHECKPOINT_DEADLINE = 120.0 + 15.0  # checkpoint_timeout_s + command_grace_s: when the old code first re-asked


def fleet(store: Store, tmp_path, **kwargs) -> SilentFleet:
    f = SilentFleet(store, tmp_path, **kwargs).seed()
    f.begin()
    return f


def kinds(f: SilentFleet, kind: str, host: str | None = None) -> list[str]:
    """The statuses of the move's commands of this kind (to this host)."""
    return [status for k, h, status in f.commands() if k == kind and (host is None or h == host)]


@pytest.mark.parametrize("silent_at, claimed", [(T0 + 2.0, True), (T0 - 0.5, False)],
                         ids=["request-claimed", "request-pending"])
def test_a_move_whose_source_falls_silent_awaiting_its_checkpoint_gives_up_once_it_counts_silent(
        any_store: Store, tmp_path, silent_at: float, claimed: bool) -> None:
    f = fleet(any_store, tmp_path, silent_at={SRC: silent_at, DST: None})
    f.takes["checkpoint"] = 30.0  # the source claims the request, then falls silent before it answers
    state, at = f.run()
    assert state == "failed"
    assert at < FIRST_CHECKPOINT_DEADLINE  # as soon as the source counts as silent, not after three requests
    assert kinds(f, "checkpoint") == (["running"] if claimed else ["failed"])  # one request, withdrawn if unclaimed
    assert kinds(f, "stop") == [] and kinds(f, "relaunch") == []
    log = f.log()
    assert "given up: host src has not been heard from for 12" in log and "nothing was stopped" in log
    assert (f.running_on, f.placement_host(), f.workflow_state(), f.job_down_for(T0 + at)) == (SRC, SRC, "running", 0)


def test_a_move_whose_target_falls_silent_before_the_stop_is_abandoned_with_the_job_running(
        any_store: Store, tmp_path) -> None:
    # the target was heard from 110 s before the move was begun (it was allowed then); the checkpoint takes 15 s
    f = fleet(any_store, tmp_path, silent_at={SRC: None, DST: T0 - 110.0})
    f.takes["checkpoint"] = 15.0
    state, at = f.run()
    assert state == "failed"
    assert "abandoned: host dst has not been heard from" in f.log() and "nothing was stopped" in f.log()
    assert kinds(f, "stop") == [] and kinds(f, "relaunch") == []  # the job was never touched
    assert (f.running_on, f.placement_host(), f.workflow_state(), f.job_down_for(T0 + at)) == (SRC, SRC, "running", 0)


def test_a_stop_not_yet_claimed_when_the_target_falls_silent_is_withdrawn_and_the_job_runs_on(
        any_store: Store, tmp_path) -> None:
    f = fleet(any_store, tmp_path, silent_at={SRC: None, DST: T0 - 114.0})  # silent from T0 + 6
    assert drive(any_store, f.action_id, settings=SETTINGS, now=T0) == "checkpoint_requested"
    f.tick(T0 + 1.0)  # the source's agent claims the request
    f.tick(T0 + 6.0)  # and answers it
    assert drive(any_store, f.action_id, settings=SETTINGS, now=T0 + 6.0) == "checkpointed"
    # the target heard from 120 s ago, not more: the stop is sent
    assert drive(any_store, f.action_id, settings=SETTINGS, now=T0 + 6.0) == "checkpointed"
    assert kinds(f, "stop") == ["pending"]
    # before the source's agent claims it, the target counts as silent
    assert drive(any_store, f.action_id, settings=SETTINGS, now=T0 + 6.5) == "failed"
    f.tick(T0 + 7.0)  # the source's agent finds nothing to run
    assert kinds(f, "stop") == ["failed"] and "abandoned: host dst" in f.log()
    assert (f.running_on, f.placement_host(), f.workflow_state(), f.job_down_for(T0 + 7)) == (SRC, SRC, "running", 0)


def test_a_move_whose_target_falls_silent_after_the_stop_is_put_back_at_once(any_store: Store, tmp_path) -> None:
    # heard from 100 s before the move: the job is stopped at T0 + 7, the target counts as silent from T0 + 20
    f = fleet(any_store, tmp_path, silent_at={SRC: None, DST: T0 - 100.0})
    state, at = f.run()
    assert state == "rolled_back"
    # one relaunch at the target, withdrawn when it fell silent, not three tries until the launch-confirm deadline
    assert kinds(f, "relaunch", DST) == ["failed"]
    assert kinds(f, "relaunch", SRC) == ["done"]
    assert "host dst has not been heard from for 12" in f.log() and "from its checkpoint, at once" in f.log()
    assert (f.running_on, f.placement_host(), f.workflow_state(), f.most_copies) == (SRC, SRC, "running", 1)


def test_a_stop_claimed_before_the_target_falls_silent_is_awaited_then_the_job_is_put_back(
        any_store: Store, tmp_path) -> None:
    # the source claims the stop at T0 + 8, the target counts as silent from T0 + 8.5, the stop is answered at T0 + 16
    f = fleet(any_store, tmp_path, silent_at={SRC: None, DST: T0 - 111.5})
    f.takes["stop"] = 8.0
    state, _ = f.run()
    assert state == "rolled_back"
    assert kinds(f, "stop", SRC) == ["done"] and kinds(f, "relaunch", DST) == [] and kinds(f, "relaunch", SRC) == [
        "done"]
    assert "putting it back where it was, from its checkpoint, at once" in f.log()
    assert (f.running_on, f.placement_host(), f.workflow_state(), f.most_copies) == (SRC, SRC, "running", 1)


def test_a_move_whose_source_falls_silent_with_a_stop_claimed_says_it_does_not_know_whether_the_job_stopped(
        any_store: Store, tmp_path) -> None:
    # the stop is sent at T0 + 7, the source claims it at T0 + 8 and is silent from T0 + 8.5; with a 20 s silence limit
    # the source counts as silent before the stop's own deadline (T0 + 37), so the silence decides
    settings = SETTINGS.model_copy(update={"host_silent_after_s": 20.0})
    f = fleet(any_store, tmp_path, silent_at={SRC: T0 + 8.5, DST: None}, settings=settings)
    f.takes["stop"] = 30.0
    state, at = f.run(until=600)
    assert state == "failed"
    assert at < 37  # at the silence, before the claimed stop's deadline
    error = f.log().split(" | ")[-1]
    assert error.startswith("given up: host src has not been heard from for 2")
    assert "whether job stopped is not known" in error and "runs on" not in error
    assert kinds(f, "stop") == ["running"] and kinds(f, "relaunch") == []  # started nowhere else
    assert (f.placement_host(), f.workflow_state()) == (SRC, "running")  # its agent settles it when heard from


def test_unanswered_stops_are_tried_three_times_and_not_more(any_store: Store, tmp_path) -> None:
    # the source's agent heartbeats and claims, but never answers a stop (its handler hangs): the move ends after the
    # third stop, saying that it does not know whether the job stopped
    f = fleet(any_store, tmp_path)
    f.takes["stop"] = 10_000.0
    state, _ = f.run(until=600)
    assert state == "failed"
    assert len(kinds(f, "stop")) == 3 and kinds(f, "relaunch") == []
    error = f.log().split(" | ")[-1]
    assert "could not be stopped on src after 3 tries" in error and "whether it stopped is not known" in error


def test_a_move_between_hosts_heard_from_goes_through(any_store: Store, tmp_path) -> None:
    f = fleet(any_store, tmp_path)
    state, _ = f.run()
    assert state == "resumed"
    assert (f.running_on, f.placement_host(), f.workflow_state(), f.most_copies) == (DST, DST, "running", 1)
