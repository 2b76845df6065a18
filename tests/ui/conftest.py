"""Fixtures for the dashboard tests: a seeded SQLite store named by FLEETLENS_DB_URL, and an operator login."""

from __future__ import annotations

from pathlib import Path

import pytest

from store.db import Store
from store.migrations import upgrade
from store.settings import get_settings
from tests.ui.seed import Seeded, seed
from ui.dashboard.auth import hash_password

UI = Path(__file__).resolve().parents[2] / "ui" / "dashboard"
OPERATOR, OPERATOR_PASSWORD = "olga", "correct horse battery"


@pytest.fixture
def operators_env(fleet_home: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    entry = f"{OPERATOR}:{hash_password(OPERATOR_PASSWORD, iterations=2000)}"
    monkeypatch.setenv("FLEETLENS_UI_OPERATORS", entry)
    get_settings(fresh=True)
    return entry


@pytest.fixture
def empty_store(fleet_home: Path, monkeypatch: pytest.MonkeyPatch, operators_env: str) -> Store:
    fleet_home.mkdir(parents=True, exist_ok=True)
    url = f"sqlite:///{fleet_home / 'fleetlens.db'}"
    monkeypatch.setenv("FLEETLENS_DB_URL", url)
    store = Store(url)
    upgrade(store)
    yield store
    store.dispose()


@pytest.fixture
def seeded(empty_store: Store) -> tuple[Store, Seeded]:
    return empty_store, seed(empty_store)
