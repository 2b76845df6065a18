"""A MIG slice's share of its GPU, and the waste function bounding a slice's waste by that share."""

from __future__ import annotations

import pandas as pd
import pytest

from analyzer.device_share import GIB, share_of
from analyzer.ranking import FINDING_COLUMNS
from analyzer.waste import Held, waste


@pytest.mark.parametrize(("name", "memory", "share"), [
    ("NVIDIA H100 80GB HBM3", None, 1.0),
    ("NVIDIA A100-SXM4-80GB MIG 1g.10gb", None, 1 / 7),
    ("NVIDIA A100-SXM4-80GB MIG 3g.40gb", None, 3 / 7),
    ("NVIDIA H100 80GB HBM3 MIG 7g.80gb", None, 1.0),
    ("NVIDIA A100-SXM4-40GB MIG 1c.3g.20gb", None, 3 / 7),  # a compute instance of a 3g GPU instance
    ("NVIDIA A30 MIG 2g.12gb", None, 2 / 4),
    ("NVIDIA A100-SXM4-80GB MIG instance 3", 20 * GIB, 0.25),  # no profile: its memory against the parent's
    ("NVIDIA A100-SXM4-80GB MIG instance 3", None, 1.0),  # nothing to go on: whole, never made up smaller
    (None, None, 1.0),
])
def test_a_slice_is_its_profiles_share(name, memory, share):
    assert share_of(name, memory) == pytest.approx(share)


def _finding(dev: int, claim: float, **evidence) -> pd.DataFrame:
    row = {c: None for c in FINDING_COLUMNS} | {"id": 1, "workflow_id": "job", "device_id": dev, "rule": "idle_holder",
                                                "source": "telemetry", "gpu_hours_per_day": claim,
                                                "evidence": evidence}
    return pd.DataFrame([row], columns=FINDING_COLUMNS)


def test_an_idle_slice_gives_back_its_share_of_a_gpu_not_a_whole_one():
    # idle the whole of a 6 h detector window on a 1g.10gb slice: a day of it is 24/7 GPU-hours, not 24
    f = _finding(5, 24.0, held_hours=6.0, window_hours=6.0)
    whole = waste(f, Held())
    sliced = waste(f, Held(shares={5: 1 / 7}))
    assert whole.recoverable_gpu_hours_per_day == pytest.approx(24.0)
    assert sliced.recoverable_gpu_hours_per_day == pytest.approx(24.0 / 7)
    assert sliced.held_gpu_hours_per_day == pytest.approx(24.0 / 7)
    # with rollups (already weighted), the bound of a day is the slice's share of 24 h
    capped = waste(f, Held(workflows={"job": 10.0}, devices={5: 10.0}, shares={5: 1 / 7}))
    assert capped.recoverable_gpu_hours_per_day == pytest.approx(24.0 / 7)
