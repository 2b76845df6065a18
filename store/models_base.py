"""The schema's declarative base: the column types every table module shares (64-bit ids, JSON)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import JSON, BigInteger, Double, Integer
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase

# 64-bit surrogate keys on PostgreSQL; SQLite only auto-increments INTEGER PRIMARY KEY.
BigId = BigInteger().with_variant(Integer, "sqlite")
Json = JSON().with_variant(JSONB(), "postgresql")


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: Json, list[Any]: Json, float: Double}
