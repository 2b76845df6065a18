"""The Sweeps page on a recorded sweep (AppTest): the numbers shown are the store's."""

from __future__ import annotations

from store.settings import get_settings
from store.workflows import upsert_workflow
from tests.sweeps.test_records import record_sample_sweep
from tests.ui.helpers import assert_clean, metrics, page, texts


def test_sweeps_page_shows_the_recorded_sweep(empty_store) -> None:
    written = record_sample_sweep(empty_store, "nas-sha")
    at = page("sweeps")
    assert_clean(at)
    shown = metrics(at)
    assert shown["Trials"] == "2"
    assert shown["Resizes"] == str(sum(e.kind == "resize" for e in written))
    assert len(at.get("plotly_chart")) == 2
    assert any("re-filled" in str(df.value.reason.tolist()) for df in at.dataframe if "reason" in df.value)


def test_sweeps_page_without_sweeps_says_how_to_get_one(empty_store) -> None:
    at = page("sweeps")
    assert_clean(at)
    assert any("No sweep recorded yet" in str(i.value) for i in at.info)


def test_trials_grouped_by_the_environment_are_listed(empty_store) -> None:
    with empty_store.session() as session:
        upsert_workflow(session, "job-1", labels={"sweep": "grid-7", "trial": "t-1"})
        upsert_workflow(session, "job-2", labels={"team": "x"})
    at = page("sweeps")
    assert_clean(at)
    shown = [df.value for df in at.dataframe]
    assert len(shown) == 1 and list(shown[0].workflow) == ["job-1"] and list(shown[0].sweep) == ["grid-7"]


def test_sweeps_page_with_the_database_down_is_a_banner(fleet_home, monkeypatch) -> None:
    monkeypatch.setenv("FLEETLENS_DB_URL", "postgresql+psycopg://postgres@127.0.0.1:1/fleetlens")
    get_settings(fresh=True)
    at = page("sweeps")
    assert_clean(at)
    assert "Database unavailable" in texts(at.error)
