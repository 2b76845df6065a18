"""A Slurm node's state however it is written (sinfo --json's base state and flags, or the text sinfo and scontrol
print): whether the node answers Slurm, and whether it takes new jobs."""

from __future__ import annotations

import pytest

from store.slurm_nodes import closed_reason, node_label, state_text, state_words, unresponsive_reason


@pytest.mark.parametrize(("state", "flags", "words"), [
    ("mixed", ["DRAIN"], {"MIXED", "DRAIN"}),
    ("idle*", [], {"IDLE", "NOT_RESPONDING"}),
    ("IDLE+DRAIN", [], {"IDLE", "DRAIN"}),
    ("drained", [], {"DRAIN"}),
    ("draining*", [], {"DRAIN", "NOT_RESPONDING"}),
    ("maint", [], {"MAINTENANCE"}),
    ("failing", [], {"FAIL"}),
    ("down", ["not_responding"], {"DOWN", "NOT_RESPONDING"}),
])
def test_a_state_is_read_however_it_is_written(state, flags, words):
    assert state_words(state, flags) == words


@pytest.mark.parametrize(("state", "flags", "answers", "takes_jobs"), [
    ("mixed", [], True, True),
    ("allocated", ["PLANNED"], True, True),  # planned by the backfill scheduler: taking jobs
    ("mixed", ["DRAIN"], True, False),
    ("idle", ["MAINTENANCE", "RESERVED"], True, False),
    ("idle", ["RESERVED"], True, False),
    ("idle", ["REBOOT_REQUESTED"], True, False),
    ("down", [], False, False),
    ("idle", ["NOT_RESPONDING"], False, False),
    ("mixed*", [], False, False),
    ("idle", ["FAIL"], False, False),
    ("idle", ["POWERED_DOWN"], False, False),
    ("unknown", [], False, False),  # slurmctld restarted and has not heard from its slurmd yet
])
def test_whether_a_node_answers_and_takes_new_jobs(state, flags, answers, takes_jobs):
    label = node_label(state, flags, "r")
    assert (unresponsive_reason(label) is None) is answers
    assert (unresponsive_reason(label) is None and closed_reason(label) is None) is takes_jobs


def test_a_host_no_slurm_import_listed_says_nothing():
    assert unresponsive_reason(None) is None and closed_reason({}) is None
    assert closed_reason({"gpus": 4, "shards": 8}) is None  # labels written before the import kept the state
    assert state_text(node_label("mixed", ["drain"], None)) == "MIXED+DRAIN"
