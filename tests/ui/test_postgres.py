"""The dashboard's queries on PostgreSQL: every page renders the seeded store's numbers there too."""

from __future__ import annotations

import pytest

from store.settings import get_settings
from tests.ui.helpers import assert_clean, metrics, page
from tests.ui.seed import seed

pytestmark = pytest.mark.pg


@pytest.fixture
def pg_seeded(pg_store, pg_url, fleet_home, monkeypatch):
    monkeypatch.setenv("FLEETLENS_DB_URL", pg_url)
    get_settings(fresh=True)
    return pg_store, seed(pg_store)


@pytest.mark.parametrize("window", ["1 hour", "7 days"])
def test_pages_on_postgres(pg_seeded, window):
    for name in ("fleet", "workflow", "findings", "enforcement"):
        at = page(name)
        if name != "findings":
            at.selectbox(key="fl_window").set_value(window).run()
        assert_clean(at)
        assert not at.error, [e.value for e in at.error]
    at = page("fleet")
    at.selectbox(key="fl_window").set_value(window).run()
    assert metrics(at)["Devices"] == "8"
    assert float(metrics(at)["Device-hours held"].replace(",", "")) > 5
