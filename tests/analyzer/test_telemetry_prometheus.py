"""The Alibaba GenAI day read back from a real Prometheus gives the findings and the ranking of the direct replay.

The recording (143 containers, 22.8 h, one sample about every 57 s) is written as OpenMetrics under dcgm-exporter's
names and labels (collector.recordings.openmetrics_writer), backfilled with `promtool tsdb create-blocks-from
openmetrics`, served by Debian's Prometheus, and imported with `fleetlens import-prometheus` at a 30 s step: half the
recording's interval, so each recorded sample lands in a step of its own (at 60 s one in twenty shares a step with
its neighbour and is lost, which moves GPU-hours by a few per cent). The whole day and every container are used: a
shorter window changes which containers cross the detectors' duration thresholds, so only the day compares with the
pinned counts of tests/analyzer/test_telemetry_alibaba.py.

What moves, and why it is allowed: a sample's time is snapped to the end of its step (up to 30 s later), so one
container on the edge of low_utilization's threshold can swap with another; everything else must agree.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from analyzer.ranking import rank_teams, rank_workflows
from analyzer.telemetry import detect
from collector.importers.prometheus import import_prometheus
from collector.recordings.load import load_into_store
from collector.recordings.openmetrics_writer import write_openmetrics
from collector.recordings.read import read_recording
from store.db import Store
from store.migrations import upgrade
from store.settings import Settings
from tests.analyzer.test_telemetry_alibaba import DAY, FLAGGED, FLAGGED_CONTAINERS, NOW, RECORDED_END
from tests.conftest import FLEET
from tests.prometheus_server import backfill, prometheus

STEP = 30.0


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> Iterator[tuple[Store, Store, object]]:
    folder = tmp_path_factory.mktemp("alibaba-prometheus")
    rec = read_recording(FLEET)
    assert write_openmetrics(rec, folder / "fleet.om") > 400_000
    backfill(folder / "fleet.om", folder / "data")
    (folder / "fleet.om").unlink()  # 110 MB of text, in the blocks now
    imported = Store(f"sqlite:///{folder / 'imported.db'}")
    direct = Store(f"sqlite:///{folder / 'direct.db'}")
    upgrade(imported)
    upgrade(direct)
    with prometheus(folder, data_dir=folder / "data") as server:
        summary = import_prometheus(imported, server.url, since=rec.start, until=rec.end, step=STEP,
                                    settings=Settings(home=folder), now=NOW)
    load_into_store(direct, rec, end_at=RECORDED_END)
    yield imported, direct, summary
    imported.dispose()
    direct.dispose()


@pytest.fixture(scope="module")
def detected(stores) -> tuple[list, list]:
    """The detectors run once over the day in each store (imported, direct), their findings recorded there: the
    detector test reads the findings, the ranking test the stores' rows (detect is idempotent, so running it again
    for each test repeated the same work, up to half a minute)."""
    imported, direct, _ = stores
    return detect(imported, now=NOW, window_s=DAY), detect(direct, now=NOW, window_s=DAY)


def _container(workflow_id: str) -> str:
    return workflow_id.rsplit("/", 1)[-1]  # k8s-<team>/<pod>: the pod is the direct replay's workflow id


@pytest.mark.slow
def test_import_reads_every_container(stores):
    _, _, summary = stores
    assert (summary.devices, summary.workflows, summary.hosts) == (143, 143, 18)
    assert summary.series == 3 * 143 and not summary.skipped
    assert summary.device_samples > 160_000


@pytest.mark.slow
def test_detectors_find_what_the_direct_replay_finds(detected):
    found_via, found_raw = detected
    via = {(f.rule, _container(f.workflow_id)): f for f in found_via}
    raw = {(f.rule, f.workflow_id): f for f in found_raw}
    per_rule = {}
    for rule, _ in via:
        per_rule[rule] = per_rule.get(rule, 0) + 1
    assert per_rule == FLAGGED  # the pinned counts of the direct path
    assert len({c for _, c in via}) in (FLAGGED_CONTAINERS, FLAGGED_CONTAINERS + 1)
    differ = set(via) ^ set(raw)
    assert len(differ) <= 2 and all(rule == "low_utilization" for rule, _ in differ), differ
    assert all((via.get(k) or raw[k]).gpu_hours_per_day < 5.0 for k in differ)  # borderline, small
    both = set(via) & set(raw)
    assert all(via[k].severity == raw[k].severity for k in both)
    assert max(abs(via[k].gpu_hours_per_day - raw[k].gpu_hours_per_day) for k in both) < 0.1
    for rule in FLAGGED:
        hours = [sum(f.gpu_hours_per_day for (r, _), f in d.items() if r == rule) for d in (via, raw)]
        assert hours[0] == pytest.approx(hours[1], rel=0.005), rule


@pytest.mark.slow
def test_ranking_matches_the_direct_replay(stores, detected):
    imported, direct, _ = stores  # with the findings `detected` recorded in each
    via, raw = rank_workflows(imported, now=NOW), rank_workflows(direct, now=NOW)
    via["workflow_id"] = via["workflow_id"].map(_container)
    assert list(via["workflow_id"][:10]) == list(raw["workflow_id"][:10])
    assert set(via["workflow_id"][:20]) == set(raw["workflow_id"][:20])
    assert via["recoverable_gpu_hours_per_day"].sum() == pytest.approx(raw["recoverable_gpu_hours_per_day"].sum(),
                                                                       rel=0.005)
    assert dict(zip(via["workflow_id"], via["team"], strict=True)) == dict(
        zip(raw["workflow_id"], raw["team"], strict=True))  # namespace -> team, as the direct replay assigns them
    teams_via = rank_teams(imported, now=NOW).set_index("team")["recoverable_gpu_hours_per_day"]
    teams_raw = rank_teams(direct, now=NOW).set_index("team")["recoverable_gpu_hours_per_day"]
    assert list(teams_via.index) == list(teams_raw.index)
    assert teams_via.to_numpy() == pytest.approx(teams_raw.to_numpy(), rel=0.01)
