"""The hourly rows of a period, whether `fleetlens rollup` has run or not: the stored rollups of the hours rolled up,
and the same rollup functions over the raw samples of the closed hours that are not yet.

Every per-day figure of the ranking, the waste function and metrics-serve reads its held GPU-hours from here, so one
figure has one basis, named in the output: GPU-hours per day averaged over the period's closed hours. Without this,
`rank` right after an import counted the detectors' own windows as rates (a GPU held 2 h of a 2 h import: 24 GPU-h a
day) and, after a rollup, the period's average (2 GPU-h a day); and listed only the workflows with findings.
"""

from __future__ import annotations

import math
import time

import numpy as np
import pandas as pd
from sqlalchemy import select

from analyzer.rollups import HOUR, device_rollups, hour_runs, workflow_rollups
from analyzer.telemetry.frame import load_window
from analyzer.telemetry.thresholds import load_thresholds
from store.db import Store
from store.models import Rollup

COLUMNS = ["scope", "subject", "team", "hour", "gpu_hours_held", "gpu_hours_active", "util_mean", "samples"]
PER_DAY = "averaged over the closed hours of the period"  # what "GPU-hours per day" means wherever it is shown


def closed_hours(start: float, end: float) -> tuple[float, float]:
    """[first, last) of the whole hours inside [start, end): the hour still running has no rollup yet."""
    return math.ceil(start / HOUR) * HOUR, math.floor(end / HOUR) * HOUR


def period_rows(store: Store, start: float, end: float) -> pd.DataFrame:
    """Rows (COLUMNS) of the device and workflow rollups of the closed hours in [start, end)."""
    first, last = closed_hours(start, end)
    r = Rollup
    with store.session() as session:
        stored = pd.DataFrame(
            [tuple(x) for x in session.execute(
                select(r.scope, r.subject, r.team, r.hour, r.gpu_hours_held, r.gpu_hours_active, r.util_mean,
                       r.samples).where(r.hour >= first, r.hour < last))],
            columns=COLUMNS)
    rolled = set(stored["hour"].astype(float).tolist())
    missing = [float(h) for h in np.arange(first, last, HOUR) if float(h) not in rolled]
    computed: list[dict] = []
    common = load_thresholds().common if missing else None
    for seg_start, seg_end in hour_runs(missing):
        window = load_window(store, seg_start, seg_end, common)
        computed += device_rollups(window, time.time()) + workflow_rollups(window, time.time())
    if not computed:
        return stored
    raw = pd.DataFrame(computed).reindex(columns=COLUMNS)
    return raw if stored.empty else pd.concat([stored, raw], ignore_index=True)

