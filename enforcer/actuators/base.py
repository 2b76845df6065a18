"""The actuator seam: how one planned move is carried out through one engine, and what each step came to.

The planner is pure (fleet state in, moves out) and imports no actuator. The plan-level checks (target usable, target
capacity, checkpoint storage readable from the target: enforcer.move_checks) run once per move, when it is begun
(`enforcer.migration.plan_action`, before the action is recorded), so an actuator only ever receives an accepted move
of the engine that runs the job. An actuator either performs the steps itself (signed
commands to agents) or asks an engine that performs the move and lets us only ask and observe (a Slurm requeue, a
Ray Tune resource change). Either way it reports every step as a `StepOutcome`, and its own verification (checkpoint
size and sha256, resume step at or above the checkpoint's) runs once, inside it.

An actuator is driven, never blocking: `begin` records the move (an action in the store) and returns its id;
`advance` takes at most one step from what the store and the engine say now, so it is idempotent and picks up after
a crash of the enforcer. A move ends resumed, rolled back or failed, each with its reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar, Protocol, runtime_checkable


class Step(StrEnum):
    """What a step of a move came to; the action log records one outcome per step."""

    PLANNED = "planned"
    CHECKPOINTED = "checkpointed"  # training_step: the checkpoint's step
    STOPPED = "stopped"
    PLACED = "placed"  # on its new GPU(s), lane or shares
    RESUMED = "resumed"  # training_step: the step it resumed at (never below the checkpoint's)
    ROLLED_BACK = "rolled_back"  # running as it was, from its checkpoint
    FAILED = "failed"  # the job is left as it was, or the reason says where it is


TERMINAL_STEPS = frozenset({Step.RESUMED, Step.ROLLED_BACK, Step.FAILED})


@dataclass(frozen=True)
class Move:
    """One move the planner decided, independent of the engine that carries it out."""

    workflow_id: str
    to_device_id: int
    from_device_id: int | None = None
    to_lane_id: int | None = None  # an existing lane; None with new_lane_size: open one; both None: whole device
    new_lane_size: int | None = None
    compute_share: float = 1.0
    policy: str | None = None
    plan_id: int | None = None
    expected_slowdown: float | None = None
    reason: str = ""
    # engine-specific request (e.g. Slurm: {"gres": "shard:1"}; Ray Tune: {"GPU": 0.5})
    request: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StepOutcome:
    """One step's result, as the action log and the Enforcement page show it."""

    action_id: int
    step: Step
    ok: bool
    at: float
    detail: str = ""
    training_step: int | None = None

    @property
    def terminal(self) -> bool:
        return self.step in TERMINAL_STEPS


@runtime_checkable
class Actuator(Protocol):
    """How moves of the jobs of one engine are carried out. `engine` names it in the store (`actions.engine`)."""

    engine: ClassVar[str]

    def begin(self, move: Move, *, now: float) -> int:
        """Record the move (state 'planned'); return the action id. Raises a FleetlensError, writing nothing, when
        the move makes no sense for this engine."""
        ...

    def advance(self, action_id: int, *, now: float) -> list[StepOutcome]:
        """Take at most one step of the action; return the outcomes recorded by it (empty while it waits)."""
        ...
