"""Placement and ordering policies, one per module behind `Policy`; `get_policy(name)` builds one by name."""

from __future__ import annotations

from typing import Any

from enforcer.discipline import JOB_ORDER
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


def kind_of(policy_name: str) -> str:
    """The lane order (enforcer.discipline) of the policy of this name, from the policy itself; a name this
    registry does not know (a simulator baseline) takes job order."""
    cls = POLICIES.get(policy_name.split("/")[0].strip().lower())
    return cls.lane_order if cls is not None else JOB_ORDER


def policy_names() -> list[str]:
    return sorted(POLICIES)


def get_policy(name: str, **options: Any) -> Policy:
    """A policy by name (case-insensitive); options go to its constructor (model=, max_slowdown=)."""
    cls = POLICIES.get(str(name).strip().lower())
    if cls is None:
        raise InvalidInput(f"unknown policy {name!r}; known policies: {', '.join(policy_names())}")
    return cls(**options)


__all__ = ["DEFAULT_MAX_SLOWDOWN", "POLICIES", "Fair", "Fifo", "Pack", "Policy", "Srtf", "get_policy",
           "kind_of", "policy_names", "register"]
