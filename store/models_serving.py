"""The schema of serving: per-minute request measurements, each serving application's SLO, and the optional raw
requests (opt-in, capped per workflow: store.serving_raw)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import BigInteger, ForeignKey, Index, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from store.models_base import Base, BigId


class ServingMinute(Base):
    """One serving application's requests in one minute (by arrival), as the job SDK's serving mode measured them:
    exact counts and sums, and execution-time and latency histograms (store.latency_sketch: quantiles to 1 %), the
    execution times also per batch-size class (store.batch_sizes). Several hosts or flushes add into the same row."""

    __tablename__ = "serving_minutes"
    __table_args__ = (Index("ix_serving_minutes_minute", "minute"),)

    workflow_id: Mapped[str] = mapped_column(ForeignKey("workflows.id", ondelete="CASCADE"), primary_key=True)
    app: Mapped[str] = mapped_column(String(255), primary_key=True)
    minute: Mapped[float] = mapped_column(primary_key=True)  # epoch seconds of the minute's start
    n: Mapped[int] = mapped_column(BigInteger, default=0)  # requests served (a batch's members each count)
    dropped: Mapped[int] = mapped_column(BigInteger, default=0)  # shed by the scheduler: counted, never served
    met: Mapped[int | None] = mapped_column(BigInteger)  # served within the SLO the SDK knew; None: no SLO then
    exec_sum: Mapped[float] = mapped_column(default=0.0)
    exec_sumsq: Mapped[float] = mapped_column(default=0.0)
    wait_sum: Mapped[float] = mapped_column(default=0.0)
    latency_sum: Mapped[float] = mapped_column(default=0.0)
    batch_sum: Mapped[int] = mapped_column(BigInteger, default=0)  # sum over requests of their batch's size
    devices: Mapped[int] = mapped_column(Integer, default=1)  # devices the service held that minute (largest reported)
    exec_hist: Mapped[dict[str, Any]] = mapped_column(default=dict)
    latency_hist: Mapped[dict[str, Any]] = mapped_column(default=dict)
    # {batch-size class: {n, batch_sum, hist}} (store.batch_sizes, revision 0016); None: a part of the minute was
    # recorded without them (stored before 0016, or by an SDK from before it)
    exec_by_batch: Mapped[dict[str, Any] | None]


class ServingApp(Base):
    """A serving application's SLO: the latency (queue wait + execution) its requests must meet."""

    __tablename__ = "serving_apps"

    workflow_id: Mapped[str] = mapped_column(ForeignKey("workflows.id", ondelete="CASCADE"), primary_key=True)
    app: Mapped[str] = mapped_column(String(255), primary_key=True)
    slo_s: Mapped[float | None]
    target: Mapped[float] = mapped_column(default=0.99)  # the share of requests that must meet slo_s
    updated_at: Mapped[float]


class ServingRequest(Base):
    """One served request as the SDK measured it, kept when `serving_raw_requests` is on, until `serving_raw_max_rows`
    newer ones of its workflow replace it (store.serving_raw); the minute histograms hold every request."""

    __tablename__ = "serving_requests"
    __table_args__ = (Index("ix_serving_requests_workflow_arrival", "workflow_id", "arrival"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    workflow_id: Mapped[str] = mapped_column(ForeignKey("workflows.id", ondelete="CASCADE"))
    app: Mapped[str] = mapped_column(String(255))
    arrival: Mapped[float]  # epoch seconds
    wait_s: Mapped[float]
    exec_s: Mapped[float]
    latency_s: Mapped[float]
    batch_size: Mapped[int] = mapped_column(Integer)


class ServingRawCount(Base):
    """Per workflow: raw requests stored now, and those not stored or no longer stored because newer ones took
    their place under the cap (counted, never dropped silently; their minute histograms have them)."""

    __tablename__ = "serving_raw_counts"

    workflow_id: Mapped[str] = mapped_column(ForeignKey("workflows.id", ondelete="CASCADE"), primary_key=True)
    stored: Mapped[int] = mapped_column(BigInteger, default=0)
    over_cap: Mapped[int] = mapped_column(BigInteger, default=0)
