"""Placement and ordering policies, one per module behind `Policy`; `get_policy(name)` builds one by name."""

from __future__ import annotations

from typing import Any

from enforcer.policies.base import DEFAULT_MAX_SLOWDOWN, Policy
from enforcer.policies.fair import Fair
from enforcer.policies.fifo import Fifo
from enforcer.policies.pack import Pack
from enforcer.policies.srtf import Srtf
from store.errors import InvalidInput

POLICIES: dict[str, type[Policy]] = {cls.name: cls for cls in (Pack, Fair, Srtf, Fifo)}


def register(cls: type[Policy]) -> type[Policy]:
    """Add a policy class so `get_policy` knows its name."""
    POLICIES[cls.name] = cls
    return cls


def policy_names() -> list[str]:
    return sorted(POLICIES)


def get_policy(name: str, **options: Any) -> Policy:
    """A policy by name (case-insensitive); options go to its constructor (model=, max_slowdown=)."""
    cls = POLICIES.get(str(name).strip().lower())
    if cls is None:
        raise InvalidInput(f"unknown policy {name!r}; known policies: {', '.join(policy_names())}")
    return cls(**options)


__all__ = ["DEFAULT_MAX_SLOWDOWN", "POLICIES", "Fair", "Fifo", "Pack", "Policy", "Srtf", "get_policy",
           "policy_names", "register"]
