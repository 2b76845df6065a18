"""What Slurm says of a node's state, and what the enforcer makes of it: whether the node answers (else it is not
heard from, whatever else says it is alive) and whether it takes new jobs (else no move may land there).

Slurm 22.05's `sinfo --json` (openapi v0.0.38) gives a node's base state in lower case (`idle`, `mixed`,
`allocated`, `down`, ...) and its flags apart (`state_flags`: `DRAIN`, `NOT_RESPONDING`, `FAIL`, `MAINTENANCE`,
`RESERVED`, `POWERED_DOWN`, ...), with the reason an admin or Slurm gave (`reason`). A drained node shows as `idle`
with the flag `DRAIN`, a draining one as `mixed` or `allocated` with it, so the flags must be read. The Slurm import
keeps them in the host's labels (`labels.slurm`: `state`, `flags`, `reason`), as its latest listing of the node
said; nothing here reads Slurm itself. Words as other tools print them are read too (`IDLE+DRAIN`, `idle*`,
`drained`, `draining`, `maint`, `failing`), so a state is understood however it was written down.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

# Slurm has not heard from the node's slurmd, the node failed, or it is off or on its way on or off: nothing Slurm
# lists of it is a sign of life, and no job could be checkpointed or started there
UNRESPONSIVE = frozenset({"DOWN", "NOT_RESPONDING", "FAIL", "FUTURE", "UNKNOWN", "POWERED_DOWN", "POWERING_DOWN",
                          "POWERING_UP", "REBOOT_ISSUED"})
# alive, and the jobs it runs run on, but Slurm starts no new job there (drained or draining, in a maintenance
# reservation or another reservation, to be rebooted or powered down once idle): a job may be moved off it (that is
# what draining is for), never onto it
CLOSED = frozenset({"DRAIN", "MAINTENANCE", "RESERVED", "REBOOT_REQUESTED", "POWER_DOWN", "POWER_DRAIN"})
# the names sinfo's and scontrol's text give to states that are a base state and a flag together
_ALIASES = {"DRAINED": ("DRAIN",), "DRAINING": ("DRAIN",), "MAINT": ("MAINTENANCE",), "FAILING": ("FAIL",),
            "RESV": ("RESERVED",), "NO_RESPOND": ("NOT_RESPONDING",)}


def state_words(state: str | None, flags: Iterable[str] = ()) -> frozenset[str]:
    """Every word of a node's state in upper case: its base state and its flags (`idle*` is IDLE and
    NOT_RESPONDING, `drained` is DRAIN, `MIXED+DRAIN` is MIXED and DRAIN)."""
    words: set[str] = set()
    for part in [*(state or "").split("+"), *flags]:
        part = part.strip().upper()
        if part.endswith("*"):  # sinfo's mark of a node that does not respond
            words.add("NOT_RESPONDING")
            part = part.rstrip("*")
        if part:
            words.update(_ALIASES.get(part, (part,)))
    return frozenset(words)


def node_label(state: str, flags: Iterable[str], reason: str | None) -> dict[str, Any]:
    """What the import keeps of a node's state in its host's `labels.slurm` (beside its GPUs and partitions)."""
    return {"state": state, "flags": sorted({f.upper() for f in flags}), "reason": reason or None}


def state_text(label: Mapping[str, Any]) -> str:
    """A node's state as Slurm's text prints it: its base state and flags in upper case, joined by '+'."""
    base = str(label.get("state") or "unknown").upper()
    return "+".join([base, *(f for f in label.get("flags") or () if f.upper() != base)])


def _said(label: Mapping[str, Any]) -> str:
    reason = label.get("reason")
    return f"Slurm's latest listing shows it {state_text(label)}" + (f" (reason: {reason})" if reason else "")


def _reason(label: Mapping[str, Any] | None, among: frozenset[str], meaning: str) -> str | None:
    """What Slurm's latest listing said, and what it means, when the node's state has a word `among`; else None."""
    if not label or "state" not in label:
        return None
    if not state_words(label.get("state"), label.get("flags") or ()) & among:
        return None
    return f"{_said(label)}: {meaning}"


def unresponsive_reason(label: Mapping[str, Any] | None) -> str | None:
    """Why a node is not heard from by Slurm's word (its `labels.slurm`), None when Slurm says it answers (or no
    Slurm import has listed it)."""
    return _reason(label, UNRESPONSIVE, "its slurmd does not answer Slurm, or the node failed or is powered off")


def closed_reason(label: Mapping[str, Any] | None) -> str | None:
    """Why a node that answers takes no new job by Slurm's word (its `labels.slurm`), None when it takes them (or no
    Slurm import has listed it)."""
    return _reason(label, CLOSED, "its jobs run on, but Slurm starts no new job there")


def no_move_reason(label: Mapping[str, Any] | None) -> str | None:
    """Why no move may land on the node by Slurm's word (it does not answer, or takes no new job); None: one may."""
    return unresponsive_reason(label) or closed_reason(label)
