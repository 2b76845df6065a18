"""Rows that several writers create or add into at once: agents on many hosts register the same workflow, and
add the same serving minute, in the same instant.

A plain read-then-write loses to a concurrent writer twice over. Two transactions that both find no row both insert
it, and the second fails on the primary key. Two that both read a row and write back their sums keep only the last
one's. Here the row is first inserted unless it exists (INSERT ... ON CONFLICT DO NOTHING, which never fails on a
concurrent insert), then read with a row lock on PostgreSQL (SELECT ... FOR UPDATE), so a second writer waits for
the first one's commit and adds onto its result. SQLite has one writer at a time, and the insert opens its write
transaction first. Writers that lock several rows take them in one order (the caller sorts), so they never deadlock.
A row's JSON labels, where each writer sets its own keys, are merged in the UPDATE itself (`merge_labels`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, TypeVar

from sqlalchemy import func, inspect, literal, select, update
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.dialects.postgresql import insert as postgresql_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

Row = TypeVar("Row")


def insert_missing(session: Session, model: type, values: Mapping[str, Any]) -> None:
    """Insert `values` as a row of `model` unless a row with its primary key exists already (or a concurrent
    transaction inserts it first): never an error for the key."""
    insert = postgresql_insert if session.get_bind().dialect.name == "postgresql" else sqlite_insert
    session.execute(insert(model).values(**values).on_conflict_do_nothing())


def locked_row(session: Session, model: type[Row], key: Mapping[str, Any], **defaults: Any) -> Row:
    """The row of `model` with primary key `key`, created from `defaults` if missing, as it is committed now and
    locked until this transaction ends (PostgreSQL)."""
    insert_missing(session, model, {**defaults, **key})
    query = select(model).filter_by(**key).with_for_update().execution_options(populate_existing=True)
    return session.execute(query).scalar_one()


def merge_labels(session: Session, instance: Any, patch: Mapping[str, Any]) -> None:
    """Set `patch`'s keys in the `labels` JSON of `instance`'s row, merged in SQL with the labels as committed when
    the row is written, so keys another writer set since this session read the row are kept (a read-modify-write
    in Python would write back its stale copy without them). Values are scalars or lists: a None would delete the key
    on SQLite (a JSON merge patch), and an object would be merged there but replaced on PostgreSQL."""
    if not patch:
        return
    bad = sorted(k for k, v in patch.items() if v is None or isinstance(v, Mapping))
    if bad:
        raise ValueError(f"labels {bad}: a label's value must be set, and be a scalar or a list")
    model = type(instance)
    session.flush()  # this session's own changes first: the object is read back after the UPDATE
    if session.get_bind().dialect.name == "postgresql":
        merged = func.coalesce(model.labels, literal({}, JSONB)).op("||")(literal(dict(patch), JSONB))
    else:
        merged = func.json_patch(func.coalesce(model.labels, "{}"), json.dumps(dict(patch)))
    key = {c.key: getattr(instance, c.key) for c in inspect(model).primary_key}
    session.execute(update(model).filter_by(**key).values(labels=merged)
                    .execution_options(synchronize_session=False))
    session.expire(instance, ["labels"])
