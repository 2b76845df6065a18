"""The store: schema, engine and sessions, settings, bulk ingestion and shared queries."""

from store.db import Store
from store.errors import FleetlensError
from store.settings import Settings, get_settings

__all__ = ["FleetlensError", "Settings", "Store", "get_settings"]
