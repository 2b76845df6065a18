"""The schema: SQLAlchemy 2.0 typed ORM models for everything fleetlens records.

Conventions: times are UTC epoch seconds (float), bytes are bytes, fractions are 0..1, and a metric a
device could not report is NULL (missing), never 0.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import Mapped, mapped_column

from store.models_base import Base, BigId


class Host(Base):
    __tablename__ = "hosts"

    id: Mapped[str] = mapped_column(String(255), primary_key=True)
    hostname: Mapped[str] = mapped_column(String(255))
    source: Mapped[str] = mapped_column(String(16))  # nvml | cpu | replay
    agent_version: Mapped[str | None] = mapped_column(String(32))
    agent_pid: Mapped[int | None]
    started_at: Mapped[float]
    last_seen: Mapped[float] = mapped_column(index=True)
    labels: Mapped[dict[str, Any]] = mapped_column(default=dict)


class HostEvent(Base):
    """Something the agent did or met on its host outside any one job (the MPS daemon started, died, is missing)."""

    __tablename__ = "host_events"

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    ts: Mapped[float] = mapped_column(index=True)  # the dashboard reads the latest, all hosts together
    host_id: Mapped[str] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"), index=True)
    kind: Mapped[str] = mapped_column(String(32))  # e.g. mps
    level: Mapped[str] = mapped_column(String(16))  # info | warning | error
    message: Mapped[str] = mapped_column(Text)
    detail: Mapped[dict[str, Any]] = mapped_column(default=dict)


class Device(Base):
    __tablename__ = "devices"
    __table_args__ = (UniqueConstraint("host_id", "index", name="uq_devices_host_index"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    host_id: Mapped[str] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"), index=True)
    index: Mapped[int]
    uuid: Mapped[str] = mapped_column(String(128), unique=True)
    name: Mapped[str] = mapped_column(String(255))  # model, e.g. "NVIDIA A100-SXM4-80GB" or "cpu cores 0-3"
    source: Mapped[str] = mapped_column(String(16))
    memory_total: Mapped[int | None] = mapped_column(BigInteger)
    cpu_cores: Mapped[list[Any] | None]  # cpu source: the cores this device stands for
    state: Mapped[str] = mapped_column(String(16), default="ok")  # ok | lost | gone (no longer listed)
    registered_at: Mapped[float]
    last_seen: Mapped[float]


class Team(Base):
    __tablename__ = "teams"

    name: Mapped[str] = mapped_column(String(255), primary_key=True)
    movable: Mapped[bool] = mapped_column(Boolean, default=False)


class Workflow(Base):
    __tablename__ = "workflows"

    id: Mapped[str] = mapped_column(String(512), primary_key=True)
    id_source: Mapped[str] = mapped_column(String(16), default="env")  # env | slurm | k8s | cmdline | managed
    name: Mapped[str | None] = mapped_column(String(255))
    owner: Mapped[str | None] = mapped_column(String(255), index=True)
    team: Mapped[str | None] = mapped_column(String(255), index=True)
    labels: Mapped[dict[str, Any]] = mapped_column(default=dict)
    managed: Mapped[bool] = mapped_column(Boolean, default=False)
    movable: Mapped[bool] = mapped_column(Boolean, default=False)
    # managed jobs only: what the agent may relaunch, and where the job checkpoints
    command: Mapped[list[Any] | None]
    cwd: Mapped[str | None] = mapped_column(Text)
    checkpoint_dir: Mapped[str | None] = mapped_column(Text)
    # the shared location (fsspec URL) of its checkpoints; NULL: checkpoint_dir on its own host only
    checkpoint_url: Mapped[str | None] = mapped_column(Text)
    spec_env: Mapped[dict[str, Any] | None]  # environment the job is (re)launched with, fixed at registration
    # HMAC of the relaunch spec (command, cwd, environment, checkpoint location); an agent runs only a matching spec
    spec_signature: Mapped[str | None] = mapped_column(String(128))
    declared_steps: Mapped[int | None]
    gpus: Mapped[int] = mapped_column(Integer, default=1)
    # memory profile reported by the job SDK (bytes): persistent P and per-step ephemeral peak E
    mem_persistent: Mapped[int | None] = mapped_column(BigInteger)
    mem_ephemeral: Mapped[int | None] = mapped_column(BigInteger)
    state: Mapped[str] = mapped_column(String(16), default="running")  # running | finished | failed | moving
    created_at: Mapped[float]
    last_seen: Mapped[float] = mapped_column(index=True)


class Process(Base):
    __tablename__ = "processes"
    __table_args__ = (
        UniqueConstraint("host_id", "pid", "start_time", name="uq_processes_host_pid_start"),
        Index("ix_processes_workflow_last_seen", "workflow_id", "last_seen"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    host_id: Mapped[str] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"))
    pid: Mapped[int]
    start_time: Mapped[float]
    workflow_id: Mapped[str] = mapped_column(ForeignKey("workflows.id", ondelete="CASCADE"))
    cmdline: Mapped[str | None] = mapped_column(Text)
    username: Mapped[str | None] = mapped_column(String(255))
    first_seen: Mapped[float]
    last_seen: Mapped[float]
    ended_at: Mapped[float | None]


# The sample tables have no key in the database: no surrogate id, no primary-key constraint. Each row is one
# reading, written once by COPY (store/ingest.py) and read by device or workflow over a time range through the
# indexes below; nothing looks a sample up by itself. A key index would be one more index for COPY to keep up per
# row: with the id and its primary key, `fleetlens import-prometheus` took 1.36-1.76x a bare query_range fetch of
# the same series, without them 1.04-1.44x (benchmarks/prometheus_io.py, README). The ORM still wants a primary key
# for its mapper: `__mapper_args__` names one that is unique per reading as the agent and the importers write them
# (a device is read once per tick; a pid once per device per tick, the Prometheus importer's synthetic pid once per
# workflow and device), an identity for the ORM only, which the database does not enforce (a recording loaded twice
# with `replace=False` holds its readings twice).


class DeviceSample(Base):
    __tablename__ = "device_samples"
    __table_args__ = (Index("ix_device_samples_device_ts", "device_id", "ts"), Index("ix_device_samples_ts", "ts"))

    # No foreign key on the sample tables: PostgreSQL checks one per COPY row, which costs 2-3x the
    # ingestion rate (benchmarks/ingest.py); devices are never deleted while their samples are kept.
    device_id: Mapped[int] = mapped_column(BigInteger)
    ts: Mapped[float]
    gpu_util: Mapped[float | None]  # fraction of time a kernel ran
    mem_util: Mapped[float | None]
    mem_used: Mapped[int | None] = mapped_column(BigInteger)
    mem_total: Mapped[int | None] = mapped_column(BigInteger)
    power_w: Mapped[float | None]
    temperature_c: Mapped[float | None]
    sm_clock_mhz: Mapped[float | None]
    throttle_reasons: Mapped[int | None] = mapped_column(BigInteger)
    xid_errors: Mapped[int | None] = mapped_column(BigInteger)
    ecc_errors: Mapped[int | None] = mapped_column(BigInteger)
    sm_active: Mapped[float | None]  # GPM: fraction of SMs with a warp resident
    sm_occupancy: Mapped[float | None]
    tensor_active: Mapped[float | None]

    __mapper_args__ = {"primary_key": ["device_id", "ts"]}  # the ORM's identity only, see above


class ProcessSample(Base):
    __tablename__ = "process_samples"
    __table_args__ = (
        Index("ix_process_samples_workflow_ts", "workflow_id", "ts"),
        Index("ix_process_samples_device_ts", "device_id", "ts"),
    )

    device_id: Mapped[int] = mapped_column(BigInteger)  # no foreign keys here either, see DeviceSample
    workflow_id: Mapped[str] = mapped_column(String(512))
    host_id: Mapped[str] = mapped_column(String(255))
    pid: Mapped[int]
    ts: Mapped[float]
    mem_used: Mapped[int | None] = mapped_column(BigInteger)
    sm_util: Mapped[float | None]
    cpu_util: Mapped[float | None]  # cpu source: fraction of the device's cores

    __mapper_args__ = {"primary_key": ["device_id", "pid", "ts"]}  # the ORM's identity only, see DeviceSample


class StepStat(Base):
    """A batch of training steps as the job SDK reported them."""

    __tablename__ = "step_stats"
    __table_args__ = (Index("ix_step_stats_workflow_ts", "workflow_id", "ts_end"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    workflow_id: Mapped[str] = mapped_column(ForeignKey("workflows.id", ondelete="CASCADE"))
    host_id: Mapped[str | None] = mapped_column(String(255))
    pid: Mapped[int | None]
    rank: Mapped[int] = mapped_column(Integer, default=0)
    ts_start: Mapped[float]
    ts_end: Mapped[float]
    first_step: Mapped[int]
    last_step: Mapped[int]
    n_steps: Mapped[int]
    mean_s: Mapped[float]
    p50_s: Mapped[float]
    p95_s: Mapped[float]
    max_s: Mapped[float]
    mem_persistent: Mapped[int | None] = mapped_column(BigInteger)
    mem_peak: Mapped[int | None] = mapped_column(BigInteger)
    # where the memory numbers come from: "cuda" (allocator, per step) or "rss" (host memory on the CPU:
    # resident set between steps and the process's high-water mark, a rough stand-in)
    mem_source: Mapped[str | None] = mapped_column(String(8))



class ProfileRequest(Base):
    __tablename__ = "profile_requests"
    __table_args__ = (Index("ix_profile_requests_workflow_status", "workflow_id", "status"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    workflow_id: Mapped[str] = mapped_column(ForeignKey("workflows.id", ondelete="CASCADE"))
    steps: Mapped[int]
    reason: Mapped[str] = mapped_column(String(16), default="on_demand")  # on_demand | periodic
    requested_by: Mapped[str | None] = mapped_column(String(255))
    requested_at: Mapped[float]
    expires_at: Mapped[float | None]
    status: Mapped[str] = mapped_column(String(16), default="pending")  # pending|capturing|done|failed|expired
    claimed_at: Mapped[float | None]
    completed_at: Mapped[float | None]
    error: Mapped[str | None] = mapped_column(Text)


class Trace(Base):
    __tablename__ = "traces"
    __table_args__ = (Index("ix_traces_workflow_created", "workflow_id", "created_at"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    workflow_id: Mapped[str | None] = mapped_column(ForeignKey("workflows.id", ondelete="SET NULL"))
    profile_request_id: Mapped[int | None] = mapped_column(
        BigInteger, ForeignKey("profile_requests.id", ondelete="SET NULL"), index=True
    )
    host_id: Mapped[str | None] = mapped_column(String(255))
    rank: Mapped[int] = mapped_column(Integer, default=0)
    path: Mapped[str] = mapped_column(Text)
    size_bytes: Mapped[int | None] = mapped_column(BigInteger)
    steps: Mapped[int | None]
    created_at: Mapped[float]
    status: Mapped[str] = mapped_column(String(16), default="registered", index=True)
    # registered | analyzing | analyzed | failed
    error: Mapped[str | None] = mapped_column(Text)
    analyzed_at: Mapped[float | None]
    summary: Mapped[dict[str, Any] | None]  # per-rank breakdown numbers for reports and charts
    # the run analysing it (analyzer.traces.claims): its random token, when it last renewed its claim, and how many
    # claims the trace has had (a run killed outright stops renewing; past a limit the trace is failed)
    claim_token: Mapped[str | None] = mapped_column(String(64))
    claimed_at: Mapped[float | None]
    attempts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")


class Finding(Base):
    __tablename__ = "findings"
    __table_args__ = (
        Index("ix_findings_workflow_status", "workflow_id", "status"),
        Index("ix_findings_rule_status", "rule", "status"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    # one open finding per (rule, subject): re-running an analysis updates it instead of duplicating
    fingerprint: Mapped[str] = mapped_column(String(512), unique=True)
    workflow_id: Mapped[str] = mapped_column(ForeignKey("workflows.id", ondelete="CASCADE"))
    trace_id: Mapped[int | None] = mapped_column(BigInteger, ForeignKey("traces.id", ondelete="SET NULL"))
    device_id: Mapped[int | None] = mapped_column(BigInteger, ForeignKey("devices.id", ondelete="SET NULL"))
    rule: Mapped[str] = mapped_column(String(64))
    source: Mapped[str] = mapped_column(String(16))  # trace | telemetry
    severity: Mapped[str] = mapped_column(String(16))  # low | medium | high
    title: Mapped[str] = mapped_column(Text)
    evidence: Mapped[dict[str, Any]] = mapped_column(default=dict)
    location: Mapped[str | None] = mapped_column(Text)  # where in the trace (or telemetry window) to look
    cost_s_per_step: Mapped[float | None]
    gpu_hours_per_day: Mapped[float] = mapped_column(default=0.0)
    fix: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(16), default="open")  # open | acknowledged | resolved
    created_at: Mapped[float]
    updated_at: Mapped[float]
    acted_by: Mapped[str | None] = mapped_column(String(255))


class Rollup(Base):
    """One hour of one workflow or one device."""

    __tablename__ = "rollups"
    __table_args__ = (
        UniqueConstraint("scope", "subject", "hour", name="uq_rollups_scope_subject_hour"),
        Index("ix_rollups_hour", "hour"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    scope: Mapped[str] = mapped_column(String(16))  # workflow | device
    subject: Mapped[str] = mapped_column(String(512))  # workflow id or device id
    hour: Mapped[float]  # epoch seconds at the start of the hour
    team: Mapped[str | None] = mapped_column(String(255))
    samples: Mapped[int]
    gpu_hours_held: Mapped[float]
    gpu_hours_active: Mapped[float]
    util_mean: Mapped[float | None]
    util_p95: Mapped[float | None]
    sm_active_mean: Mapped[float | None]
    mem_peak: Mapped[int | None] = mapped_column(BigInteger)
    mem_total: Mapped[int | None] = mapped_column(BigInteger)
    computed_at: Mapped[float]


class LateSampleHour(Base):
    """A closed hour that samples were written into (store.late_hours): the next rollup rolls it up again, and
    deletes the mark only if its `version` (raised by every such write) is still the one it read."""

    __tablename__ = "late_sample_hours"

    hour: Mapped[float] = mapped_column(primary_key=True, autoincrement=False)  # epoch seconds, start of the hour
    version: Mapped[int] = mapped_column(BigInteger)


class TelemetryHour(Base):
    """What the telemetry detectors need of one closed hour, kept when the hour is rolled up, so judging a day
    combines 24 of these instead of reading the day's samples (analyzer.telemetry.hour_summaries). Each part is an
    Arrow IPC stream: per (workflow, device) statistics, their utilisation histograms, and the hour's idle and
    orphaned-memory runs. `key` names the thresholds it was made under; a summary of other thresholds is not used."""

    __tablename__ = "telemetry_hours"

    hour: Mapped[float] = mapped_column(primary_key=True, autoincrement=False)  # epoch seconds, start of the hour
    key: Mapped[str] = mapped_column(String(64))
    computed_at: Mapped[float]
    first_ts: Mapped[float | None]  # the hour's first sample, and the end of its last one (the span judged)
    last_end: Mapped[float | None]
    pairs: Mapped[bytes] = mapped_column(LargeBinary)
    hist: Mapped[bytes] = mapped_column(LargeBinary)
    runs: Mapped[bytes] = mapped_column(LargeBinary)


class Lane(Base):
    __tablename__ = "lanes"

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    device_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("devices.id", ondelete="CASCADE"), index=True)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    compute_share: Mapped[float]
    state: Mapped[str] = mapped_column(String(16), default="open")  # open | closed
    created_at: Mapped[float]
    closed_at: Mapped[float | None]


class Placement(Base):
    __tablename__ = "placements"
    __table_args__ = (
        Index("ix_placements_workflow_state", "workflow_id", "state"),
        Index("ix_placements_device_state", "device_id", "state"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    workflow_id: Mapped[str] = mapped_column(ForeignKey("workflows.id", ondelete="CASCADE"))
    device_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("devices.id", ondelete="CASCADE"))
    lane_id: Mapped[int | None] = mapped_column(BigInteger, ForeignKey("lanes.id", ondelete="SET NULL"))
    host_id: Mapped[str] = mapped_column(String(255))
    pid: Mapped[int | None]
    mem_persistent: Mapped[int | None] = mapped_column(BigInteger)  # P as measured when admitted (P' = charged(P))
    mem_ephemeral: Mapped[int | None] = mapped_column(BigInteger)  # E as admitted
    compute_share: Mapped[float] = mapped_column(default=1.0)
    state: Mapped[str] = mapped_column(String(16), default="active")  # pending | active | ended
    started_at: Mapped[float]
    ended_at: Mapped[float | None]


class Plan(Base):
    """One enforcement planning cycle: what it proposed, and whether it was applied."""

    __tablename__ = "plans"

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    created_at: Mapped[float] = mapped_column(index=True)
    policy: Mapped[str] = mapped_column(String(16))
    applied: Mapped[bool] = mapped_column(Boolean, default=False)
    devices_freed: Mapped[int] = mapped_column(Integer, default=0)
    moves: Mapped[list[Any]] = mapped_column(default=list)
    summary: Mapped[dict[str, Any]] = mapped_column(default=dict)


class Action(Base):
    __tablename__ = "actions"
    __table_args__ = (Index("ix_actions_workflow_state", "workflow_id", "state"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    plan_id: Mapped[int | None] = mapped_column(BigInteger, ForeignKey("plans.id", ondelete="SET NULL"))
    kind: Mapped[str] = mapped_column(String(16), default="migrate")
    # the actuator that carries the move out (enforcer.actuators): agents | slurm | ...
    engine: Mapped[str] = mapped_column(String(16), default="agents", server_default="agents")
    workflow_id: Mapped[str] = mapped_column(ForeignKey("workflows.id", ondelete="CASCADE"))
    policy: Mapped[str | None] = mapped_column(String(16))
    from_device_id: Mapped[int | None] = mapped_column(BigInteger, ForeignKey("devices.id", ondelete="SET NULL"))
    to_device_id: Mapped[int | None] = mapped_column(BigInteger, ForeignKey("devices.id", ondelete="SET NULL"))
    to_lane_id: Mapped[int | None] = mapped_column(BigInteger, ForeignKey("lanes.id", ondelete="SET NULL"))
    # planned | checkpoint_requested | checkpointed | stopped | relaunched | resumed | rolled_back | failed
    state: Mapped[str] = mapped_column(String(32), default="planned", index=True)
    expected_slowdown: Mapped[float | None]
    checkpoint_path: Mapped[str | None] = mapped_column(Text)
    checkpoint_step: Mapped[int | None]
    checkpoint_id: Mapped[int | None] = mapped_column(BigInteger)  # the checkpoints row the move resumes from
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[float]
    updated_at: Mapped[float]
    # what the actuator needs to carry on and to roll back (Slurm: job id, gres before and after)
    detail: Mapped[dict[str, Any] | None]


class ActionEvent(Base):
    __tablename__ = "action_events"
    __table_args__ = (Index("ix_action_events_action_ts", "action_id", "ts"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    action_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("actions.id", ondelete="CASCADE"))
    ts: Mapped[float]
    from_state: Mapped[str | None] = mapped_column(String(32))
    to_state: Mapped[str] = mapped_column(String(32))
    message: Mapped[str] = mapped_column(Text)
    detail: Mapped[dict[str, Any]] = mapped_column(default=dict)


class Command(Base):
    """The agents' queue: signed instructions addressed to one host."""

    __tablename__ = "commands"
    __table_args__ = (Index("ix_commands_host_status", "host_id", "status"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    host_id: Mapped[str] = mapped_column(String(255))
    kind: Mapped[str] = mapped_column(String(32))  # profile | checkpoint | stop | relaunch
    payload: Mapped[dict[str, Any]] = mapped_column(default=dict)
    nonce: Mapped[str] = mapped_column(String(64), unique=True)
    issued_at: Mapped[float]
    expires_at: Mapped[float]
    signature: Mapped[str | None] = mapped_column(String(128))
    action_id: Mapped[int | None] = mapped_column(BigInteger, ForeignKey("actions.id", ondelete="SET NULL"))
    status: Mapped[str] = mapped_column(String(16), default="pending")  # pending|running|done|failed|refused
    claimed_at: Mapped[float | None]
    done_at: Mapped[float | None]
    result: Mapped[dict[str, Any] | None]


class Checkpoint(Base):
    """A checkpoint the agent saw a job write: its step, size, location and sha256."""

    __tablename__ = "checkpoints"
    __table_args__ = (Index("ix_checkpoints_workflow_created", "workflow_id", "created_at"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    workflow_id: Mapped[str] = mapped_column(ForeignKey("workflows.id", ondelete="CASCADE"))
    action_id: Mapped[int | None] = mapped_column(BigInteger, ForeignKey("actions.id", ondelete="SET NULL"))
    host_id: Mapped[str] = mapped_column(String(255))  # the agent that saw it written
    step: Mapped[int | None]
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    url: Mapped[str] = mapped_column(Text)
    sha256: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[float]


class HostStorage(Base):
    """What a host's agent last found when it probed a checkpoint location: whether it can read it and write there
    (`readable`: both, so that a job moved to the host can resume and checkpoint again), or `error`, why not."""

    __tablename__ = "host_storage"

    host_id: Mapped[str] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"), primary_key=True)
    url: Mapped[str] = mapped_column(String(1024), primary_key=True)
    readable: Mapped[bool] = mapped_column(Boolean, default=False)
    error: Mapped[str | None] = mapped_column(Text)
    checked_at: Mapped[float]


# The newer concerns' tables live in their own modules; importing them here puts them in Base.metadata,
# so alembic, create_all and the schema check see every table.
from store import models_serving, models_slurm, models_sweeps  # noqa: E402, F401
