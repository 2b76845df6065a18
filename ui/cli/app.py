"""The `fleetlens` Typer application that every command module registers on, and shared CLI helpers."""

from __future__ import annotations

import difflib
import math
import time

import typer
from rich.console import Console
from sqlalchemy import select

from analyzer.rule_names import rule_names
from store.db import Store
from store.errors import InvalidInput, NotFound
from store.migrations import check_schema
from store.models import Finding, Workflow
from store.settings import Settings, get_settings
from store.workflows import get_workflow

app = typer.Typer(
    name="fleetlens",
    help="See how every workflow uses its GPUs, find out why it wastes them, and give idle GPUs back.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    rich_markup_mode="markdown",  # a docstring's paragraphs are reflowed, not broken where the source wraps
)
console = Console()
err_console = Console(stderr=True)


def settings() -> Settings:
    return get_settings(fresh=True)


def open_store(check: bool = True) -> Store:
    """The configured store; with `check`, refuse a database whose schema is missing or foreign."""
    store = Store.from_settings(settings())
    if check:
        check_schema(store)
    return store


def finite(option: str, value: float | None) -> float | None:
    """The value of a numeric option, refused with a one-line error when it is NaN or infinite (Typer takes "nan")."""
    if value is not None and not math.isfinite(value):
        raise InvalidInput(f"{option} must be a finite number, got {value}")
    return value


def not_future(option: str, value: float | None) -> float | None:
    """An epoch second no later than now, refused otherwise. A --now in the future (milliseconds for seconds) would
    have the detectors resolve every open finding, its devices silent for ages, and the rollup's retention delete every
    raw sample."""
    value = finite(option, value)
    if value is not None and value > time.time():
        raise InvalidInput(f"{option} {value:.0f} is in the future; give an epoch second no later than now "
                           f"({time.time():.0f}), or leave it out")
    return value


def check_filters(store: Store, workflow: str | None = None, team: str | None = None, rule: str | None = None) -> None:
    """Refuse a --workflow or --team the store has never recorded, and a --rule that is neither one of the analyzer's
    nor on a stored finding: a typo would otherwise list nothing, as a clean fleet does."""
    with store.session() as session:
        if rule is not None and rule not in rule_names() and session.scalar(
                select(Finding.id).where(Finding.rule == rule).limit(1)) is None:
            near = difflib.get_close_matches(rule, rule_names(), n=1, cutoff=0.6)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise NotFound(f"no rule {rule!r}; {hint}the rules are {', '.join(rule_names())}")
        if workflow is not None:
            get_workflow(session, workflow)
        if team is not None and session.scalar(select(Workflow.id).where(Workflow.team == team).limit(1)) is None:
            raise NotFound(f"no workflow of team {team!r} in the store; `fleetlens rank --teams` lists the teams")
