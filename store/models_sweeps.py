"""The schema of sweeps: hyper-parameter sweeps sized by Fluid and their trials' steps."""

from __future__ import annotations

from typing import Any

from sqlalchemy import ForeignKey, Index, Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from store.models_base import Base, BigId


class Sweep(Base):
    """A hyper-parameter sweep: a Ray Tune experiment (or the trials sharing FLEETLENS_SWEEP) sized by Fluid."""

    __tablename__ = "sweeps"

    id: Mapped[str] = mapped_column(String(255), primary_key=True)
    engine: Mapped[str] = mapped_column(String(32), default="ray_tune")
    gpus: Mapped[int] = mapped_column(Integer)
    settings: Mapped[dict[str, Any]] = mapped_column(default=dict)  # c, d, eta, restart_s, mode
    created_at: Mapped[float]


class SweepEvent(Base):
    """One step of a sweep's trial: start (at its base width), resize, keep (held back, and why), finish, died."""

    __tablename__ = "sweep_events"
    __table_args__ = (Index("ix_sweep_events_sweep_seq", "sweep_id", "seq"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    sweep_id: Mapped[str] = mapped_column(ForeignKey("sweeps.id", ondelete="CASCADE"))
    seq: Mapped[int] = mapped_column(Integer)
    ts: Mapped[float]
    trial_id: Mapped[str] = mapped_column(String(255))
    kind: Mapped[str] = mapped_column(String(16))
    old_width: Mapped[float]
    new_width: Mapped[float]
    steps_left: Mapped[float | None]
    reason: Mapped[str] = mapped_column(Text, default="")
