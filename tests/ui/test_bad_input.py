"""Bad input: an empty store, a database that is down, a store without schema, a bad operator setting."""

from __future__ import annotations

from pathlib import Path

import pytest

from store.settings import get_settings
from tests.ui.helpers import assert_clean, page, texts


@pytest.mark.parametrize("name", ["fleet", "workflow", "enforcement"])
def test_empty_store_says_how_to_start_an_agent(empty_store, name):
    at = page(name)
    assert_clean(at)
    assert "fleetlens agent" in texts(at.info)
    assert not at.get("plotly_chart")


def test_empty_store_findings_page(empty_store):
    at = page("findings")
    assert_clean(at)
    assert "No findings yet" in texts(at.info)


def test_database_down_is_a_banner(fleet_home, monkeypatch):
    # nothing listens on port 1: the connection is refused, as when the server is down
    monkeypatch.setenv("FLEETLENS_DB_URL", "postgresql+psycopg://postgres@127.0.0.1:1/fleetlens")
    get_settings(fresh=True)
    for name in ("fleet", "workflow", "findings", "enforcement"):
        at = page(name)
        assert_clean(at)
        banner = texts(at.error)
        assert "Database unavailable" in banner and "127.0.0.1:1" in banner


def test_store_without_schema_says_run_init(fleet_home: Path, monkeypatch):
    fleet_home.mkdir(parents=True)
    monkeypatch.setenv("FLEETLENS_DB_URL", f"sqlite:///{fleet_home / 'blank.db'}")
    get_settings(fresh=True)
    at = page("fleet")
    assert_clean(at)
    assert "fleetlens init" in texts(at.error)


def test_malformed_operator_setting_is_named(seeded, monkeypatch):
    monkeypatch.setenv("FLEETLENS_UI_OPERATORS", "olga:plaintext")
    get_settings(fresh=True)
    at = page("fleet")
    assert_clean(at)
    assert "FLEETLENS_UI_OPERATORS entry 'olga'" in texts(at.sidebar.error)
