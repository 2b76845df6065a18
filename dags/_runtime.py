"""What every fleetlens DAG shares: default arguments (retry with backoff only while the database is unreachable),
opening the store from the settings for one task, and reading the `fleetlens_enforce` Airflow Variable."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from airflow.sdk import ExceptionRetryPolicy, RetryAction, RetryRule, Variable

from store.db import Store
from store.errors import ConfigError
from store.migrations import check_schema
from store.settings import Settings, get_settings

log = logging.getLogger(__name__)

T = TypeVar("T")

START = datetime(2025, 1, 1, tzinfo=UTC)
TAGS = ["fleetlens"]
ENFORCE_VARIABLE = "fleetlens_enforce"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")

# A database that cannot be reached is worth waiting for (30 s, 1 min, 2 min, ... up to 10 min); any other
# fleetlens error (an unknown workflow, a bad setting, a failed profile) would fail the same way again.
RETRY_POLICY = ExceptionRetryPolicy(
    rules=[
        RetryRule(exception="store.errors.DatabaseUnavailable", action=RetryAction.RETRY,
                  reason="the fleetlens database is unreachable; retrying with exponential backoff"),
        RetryRule(exception="store.errors.FleetlensError", action=RetryAction.FAIL,
                  reason="a fleetlens error that retrying cannot fix; see the task log for what to do"),
    ],
)
DEFAULT_ARGS: dict[str, Any] = {
    "owner": "fleetlens",
    "retries": 5,
    "retry_delay": timedelta(seconds=30),
    "retry_exponential_backoff": 2.0,
    "max_retry_delay": timedelta(minutes=10),
    "retry_policy": RETRY_POLICY,
}


def run(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Call `fn(store, settings, *args, **kwargs)` on the store FLEETLENS_DB_URL names, then close the store."""
    settings: Settings = get_settings(fresh=True)
    store = Store.from_settings(settings)
    try:
        check_schema(store)
        log.info("fleetlens store %s", store.masked_url)
        return fn(store, settings, *args, **kwargs)
    finally:
        store.dispose()


def enforce_variable() -> bool:
    """The `fleetlens_enforce` Variable: true switches enforcement on (as FLEETLENS_ENFORCE does); unset is false."""
    value = Variable.get(ENFORCE_VARIABLE, default=None)
    text = "" if value is None else str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ConfigError(f"the Airflow Variable {ENFORCE_VARIABLE} is {value!r}; set it to true or false")
