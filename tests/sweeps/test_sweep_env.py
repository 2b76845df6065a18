"""Trials of a tuner other than Ray Tune are grouped by FLEETLENS_SWEEP / FLEETLENS_TRIAL: a real training job's
SDK says so in its hello, and the agent's handlers label its workflow."""

from __future__ import annotations

import pytest

from tests.collector.agent_helpers import wait_for
from tests.collector.test_job_sdk import Served, finish, served, start_train  # noqa: F401  (the fixture)

pytestmark = pytest.mark.slow


def test_trials_named_by_the_environment_are_grouped_into_their_sweep(served: Served) -> None:  # noqa: F811
    procs = [start_train(f"job-{t}", "--mode", "tiny", "--steps", "20", FLEETLENS_SWEEP="grid-7", FLEETLENS_TRIAL=t)
             for t in ("t-0", "t-1")]
    procs.append(start_train("job-alone", "--mode", "tiny", "--steps", "20"))
    assert all(finish(p)["connected"] for p in procs)
    labels = {t: wait_for(lambda t=t: (w := served.workflow(f"job-{t}")) and w.labels.get("sweep") and w.labels)
              for t in ("t-0", "t-1")}
    assert labels["t-0"]["sweep"] == labels["t-1"]["sweep"] == "grid-7"
    assert (labels["t-0"]["trial"], labels["t-1"]["trial"]) == ("t-0", "t-1")
    alone = wait_for(lambda: served.workflow("job-alone"))
    assert "sweep" not in (alone.labels or {})
