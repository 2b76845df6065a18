"""All settings in one place (pydantic-settings, prefix FLEETLENS_); no other module reads the environment."""

from __future__ import annotations

import os
import re
import secrets
import socket
from functools import lru_cache
from pathlib import Path
from typing import Annotated

from pydantic import AliasChoices, Field, SecretStr, StringConstraints, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict, SettingsError

from store.errors import ConfigError


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FLEETLENS_", extra="ignore")

    home: Path = Field(default_factory=lambda: Path.home() / ".fleetlens")
    db_url: str | None = None
    # PostgreSQL connections each process keeps open; 0: one per use, closed after (many agents, one server)
    db_pool_size: int = Field(5, ge=0)
    secret: SecretStr | None = None
    # a blank one would record this host's samples as a host named ''
    host_id: Annotated[str, StringConstraints(strip_whitespace=True, min_length=1)] = Field(
        default_factory=socket.gethostname)

    # collector
    source: str = "auto"  # auto | nvml | cpu | replay
    cpu_cores_per_device: int = 1
    # cpu source: besides marked jobs, the host's busiest processes are reported as workflows (0: marked jobs only)
    cpu_top_processes: int = Field(8, ge=0)
    sample_interval_s: float = 1.0
    flush_interval_s: float = 10.0
    spool_max_bytes: int = 256 * 1024 * 1024
    command_ttl_s: float = 300.0
    # MPS: the agent runs NVIDIA's MPS control daemon while a lane on this host's GPUs needs it (opt-in per fleet)
    mps: bool = False
    mps_binary: str = "nvidia-cuda-mps-control"  # looked up on PATH
    mps_check_interval_s: float = Field(5.0, gt=0)  # how often the agent checks the daemon and the lanes
    # put the lanes' GPUs in EXCLUSIVE_PROCESS compute mode while the daemon runs (only MPS may open a context there)
    mps_exclusive: bool = True
    workflow: str | None = None  # FLEETLENS_WORKFLOW: set in a job's environment to name its workflow
    # FLEETLENS_SWEEP / FLEETLENS_TRIAL: set in a trial's environment by a tuner other than Ray Tune, so the trials
    # of one sweep are grouped (the SDK says so in its hello; the workflow's labels `sweep` and `trial` keep it)
    sweep: str | None = None
    trial: str | None = None
    replay_path: str | None = None  # source=replay: "alibaba", an Alibaba folder, or a `fleetlens export` file
    replay_speedup: float = 60.0  # source=replay: recorded seconds played per wall-clock second
    replay_host: str | None = None  # source=replay: play only this virtual host's devices (None = all)
    # the real cluster telemetry (Alibaba GenAI, ...) read in place, never copied
    fleet_data_dir: Path = Field(
        default_factory=lambda: Path(__file__).resolve().parents[2] / "shared" / "data" / "fleet"
    )

    # agent: serve /metrics (dcgm-exporter names plus fleetlens's own) on this port; None: do not serve
    metrics_port: int | None = Field(None, ge=0, le=65535)
    metrics_host: str = ""  # the address it listens on ("": every interface, as dcgm-exporter's default :9400)

    # importing an existing Prometheus's dcgm-exporter telemetry (`fleetlens import-prometheus`, serve, the DAG)
    prometheus_url: str | None = None  # None: serve and the DAG import nothing
    prometheus_step_s: float = Field(60.0, gt=0)  # query_range resolution: one sample per device per step
    prometheus_lookback_s: float = Field(86400.0, gt=0)  # the first import reaches this far back
    prometheus_timeout_s: float = Field(60.0, gt=0)  # one HTTP request to Prometheus
    prometheus_window_s: float = Field(21600.0, gt=0)  # fetched and written this much at a time (bounds memory)
    # ask Prometheus to gzip its answers: Prometheus compresses about 25 MB/s a core (a day of 32 GPUs: 0.12 of its
    # 0.18 CPU-s), so it pays only over a link slower than about 200 Mbit/s
    prometheus_compress: bool = False
    # the label whose value names a workflow's team, and an optional value -> team renaming (JSON in the env)
    prometheus_team_label: str = "namespace"
    prometheus_teams: dict[str, str] = Field(default_factory=dict)

    # job SDK (collector.job): read inside the training process
    rank: int = Field(0, validation_alias=AliasChoices("FLEETLENS_RANK", "RANK"))  # torchrun sets RANK
    lane: str | None = None  # FLEETLENS_LANE: set by `fleetlens run` for a job placed in a lane
    memory_fraction: float | None = Field(None, gt=0, le=1)  # applied with set_per_process_memory_fraction
    # a lane job outside its turn: its persistent share (FLEETLENS_MEMORY_FRACTION holds during its turn)
    idle_memory_fraction: float | None = Field(None, gt=0, le=1)
    resume_from: Path | None = None  # FLEETLENS_RESUME_FROM: checkpoint to restore before the first step
    resume_step: int | None = Field(None, ge=0)  # the step to resume at when the restore callback cannot say
    # FLEETLENS_MOVABLE: a Slurm job's SDK asks fleetlens to move it (its start mark says so; `job(movable=...)` too);
    # outside Slurm `fleetlens run --movable` decides, and this does nothing
    movable: bool = False
    # what Slurm tells a job's processes (the SDK's checkpoint signal and resume under Slurm: collector.slurm_job)
    slurm_job_id: int | None = Field(None, validation_alias=AliasChoices("SLURM_JOB_ID"))
    slurm_restart_count: int = Field(0, validation_alias=AliasChoices("SLURM_RESTART_COUNT"))
    cuda_visible_devices: str | None = Field(None, validation_alias=AliasChoices("CUDA_VISIBLE_DEVICES"))
    # a shard job's memory cap (collector.slurm_job): its shards on the node as Slurm says them (text: a bad value
    # means no cap, with the reason logged, never a job that fails to start), the node's name, and slurm.conf, whose
    # NodeName line gives the node's GPUs and shards (read as a file: no call to slurmctld); or the shards per GPU
    # set outright (FLEETLENS_SLURM_SHARDS_PER_GPU) where the job cannot read slurm.conf
    slurm_shards_on_node: str | None = Field(None, validation_alias=AliasChoices("SLURM_SHARDS_ON_NODE"))
    # the node's indices of the job's GPUs: which GPU's shard count is the job's where a node's are uneven
    slurm_job_gpus: str | None = Field(None, validation_alias=AliasChoices("SLURM_JOB_GPUS"))
    slurmd_nodename: str | None = Field(None, validation_alias=AliasChoices("SLURMD_NODENAME"))
    slurm_conf: Path = Field(Path("/etc/slurm/slurm.conf"), validation_alias=AliasChoices("SLURM_CONF"))
    slurm_shards_per_gpu: int | None = Field(None, ge=1)
    sdk_flush_interval_s: float = 1.0  # step summaries go to the agent at most this often...
    sdk_flush_steps: int = 10_000  # ...or after this many steps (bounds memory and sorting for tiny steps)
    sdk_retry_s: float = 30.0  # with no agent listening, try to connect again this rarely
    sdk_timeout_s: float = 5.0  # a reply slower than this drops the connection (training never waits longer)
    # serving mode (collector.serving): raw requests are opt-in; each workflow keeps its newest this many stored (the
    # older rows they replace are counted in serving_raw_counts.over_cap; the minute histograms hold every request)
    serving_raw_requests: bool = False
    serving_raw_max_rows: int = Field(100_000, ge=0)
    profile_ttl_s: float = 600.0  # a profile request no job picked up by then expires
    profile_capture_timeout_s: float = 900.0  # a claimed capture with no trace by then has failed

    # analyzer
    retention_days: float = 7.0
    profile_top_n: int = Field(5, ge=0)  # the periodic profile traces this many workflows, most GPU-hours first
    profile_steps: int = Field(20, ge=1)  # steps each periodic profile captures
    analyze_batch_size: int = Field(4, ge=1)  # traces one mapped task of the analyze DAG analyses
    # a run analysing a trace renews its claim every quarter of this; a claim not renewed for this long is a dead
    # run's (killed: OOM, SIGKILL, its host down) and the next run retakes the trace, at most this many claims in all
    trace_claim_timeout_s: float = Field(120.0, gt=0)
    trace_max_attempts: int = Field(3, ge=1)
    # a run renews its claim for at most this long: an analysis hung past it (a dead mount, a stuck read) lets its
    # claim lapse, so the trace is retried and, after the attempts, failed with the reason, never 'analyzing' for good
    trace_analysis_max_s: float = Field(7200.0, gt=0)
    # streaming trace reader: JSON text decoded per block, and the most memory one trace's kept columns may take
    # (the device's events and the CPU calls the questions name, ~96 bytes each); several ranks are read one after
    # another, so a job's ranks share the same bound
    trace_block_mb: int = Field(2, ge=1)
    trace_memory_mb: int = Field(1024, ge=16)
    detect_chunk_devices: int = Field(400, ge=0)  # devices the detectors read at once (0: the whole fleet)
    # a device with no sample for this long (its host decommissioned, its agent gone for good) has its telemetry
    # findings resolved, and they stop counting; a shorter silence (an agent down, a host rebooting) leaves them as
    # they are. Three detection windows (24 h each by default): a weekend's outage stays within it, and it is shorter
    # than the retention, whose samples show the silence. 0: never for silence alone
    silent_device_limit_s: float = Field(3 * 86400.0, ge=0)

    # enforcer
    policy: str = "pack"
    enforce: bool = False  # apply plans (otherwise dry-run)
    max_moves_per_cycle: int = 4
    cooldown_s: float = 3600.0
    movable_teams: list[str] = Field(default_factory=list)
    checkpoint_timeout_s: float = 120.0
    # where managed jobs checkpoint, as an fsspec URL (a shared folder, s3://... where s3fs is installed); unset:
    # each host's FLEETLENS_HOME/checkpoints, which only that host reads, so jobs move between its devices only
    checkpoint_url: str | None = None
    storage_probe_s: float = Field(30.0, gt=0)  # how often agents probe checkpoint locations (read and write)
    storage_probe_max_age_s: float = Field(120.0, gt=0)  # an older probe does not count when planning a move
    # a host not heard from for this long is silent: the planner and consolidation move no job onto its devices nor
    # off them (its agent could neither start nor checkpoint one; the move would only stall until its commands time
    # out). Heard from: its agent's heartbeat, every flush_interval_s, or for a node an importer keeps (Slurm), the
    # importer's last record of its devices. None: six flush intervals, at least 120 s (a slow write or a database
    # blip is not a silence, nor a Slurm node between two of its importer's runs, a minute apart) and at most
    # command_ttl_s (past it a command sent there would expire unread)
    host_silent_after_s: float | None = Field(None, gt=0)
    enforce_drive_s: float = Field(120.0, ge=0)  # one enforcement cycle drives migrations this long (0: one step)
    # a job whose memory nobody declared runs alone on a device until its memory was seen for this many steps
    # (job SDK) or process samples (NVML); only then may it share a device (admission's rule; not
    # consolidate_min_history_s: enforcer.consolidation_sizing's docstring says why the two stay apart)
    memory_seen_steps: int = Field(20, ge=1)
    # C, a GPU job's memory outside PyTorch's caching allocator (CUDA context, cuDNN / cuBLAS / NCCL workspaces),
    # charged beside its lane until the agent has measured it (NVML's per-process memory less the allocator's
    # reserved bytes): a CUDA 12 context takes ~300-600 MiB on datacenter GPUs (less with lazy module loading,
    # CUDA_MODULE_LOADING=LAZY, the default since CUDA 12.2), before any workspace. The one home of the figure.
    context_mb: int = Field(512, ge=0)
    # consolidation (enforcer.consolidate): re-pack by observed demand every interval
    consolidate_interval_s: float = Field(900.0, gt=0)
    consolidate_window_s: float = Field(3 * 3600.0, gt=0)  # recent window: peak memory, p95 utilisation
    # history a job needs before consolidation co-locates it by its observed peak (time, not memory_seen_steps'
    # steps: enforcer.consolidation_sizing's docstring says why)
    consolidate_min_history_s: float = Field(2700.0, ge=0)
    consolidate_util_cap: float = Field(1.0, gt=0)  # most summed p95 utilisation planned on one shared device
    consolidate_util_guard: float = Field(1.2, gt=0)  # summed p95 over this on a shared device moves a job off
    consolidate_max_moves_per_cycle: int = Field(40, ge=0)
    consolidate_max_moves_per_job_day: int = Field(1, ge=0)
    consolidate_downtime_s: float = Field(30.0, ge=0)  # a move's downtime, as benchmarks/migration.py measures it
    consolidate_horizon_s: float = Field(3600.0, gt=0)  # a freed device counts as given back for this long
    # hyper-parameter sweeps under Fluid (enforcer.sweeps): c, d, the data-parallel efficiency eta, the restart cost
    sweep_max_share: int = Field(2, ge=1)  # c: most trials sharing one GPU (each in a lane of its own)
    sweep_max_span: int = Field(4, ge=1)  # d: most GPUs one trial spans data-parallel
    sweep_dp_efficiency: float = Field(0.85, gt=0, le=1)  # speed of w GPUs = w * eta (w >= 2)
    sweep_restart_s: float = Field(10.0, ge=0)  # what a resize costs (restart from checkpoint)
    sweep_dynamic: bool = True  # re-fill on every promotion, pause or stop; false: fill each group once

    # Slurm (collector.importers.slurm observes, enforcer.actuators.slurm moves the jobs that opted in)
    slurm: bool = False  # FLEETLENS_SLURM: the enforcement cycle plans and moves Slurm jobs (import them first)
    slurm_usage_window_s: float = Field(300.0, gt=0)  # a job's use: its samples over this window
    slurm_bin_dir: Path | None = None  # where squeue, sinfo, scontrol and scancel are; None: on PATH
    slurm_timeout_s: float = Field(30.0, gt=0)  # one Slurm command
    slurm_team_from: str = Field("account", pattern="^(account|partition)$")  # a job's team: its account or partition
    slurm_teams: dict[str, str] = Field(default_factory=dict)  # account (or partition) -> team renaming (JSON)
    slurm_checkpoint_timeout_s: float = Field(120.0, gt=0)  # signalled job: its checkpoint must come by then
    slurm_checkpoint_max_age_s: float = Field(60.0, gt=0)  # an older checkpoint is taken again before the requeue
    slurm_resume_timeout_s: float = Field(180.0, gt=0)  # released job: it must resume (say its step) by then
    slurm_max_attempts: int = Field(2, ge=1)  # checkpoint signals per move

    # ui
    ui_port: int = Field(8501, ge=1, le=65535)  # the dashboard (`fleetlens ui`, serve, the demo)
    ui_operators: str = ""  # "name:pbkdf2_sha256$iterations$salt$hash,..."
    # `fleetlens metrics-serve`: the fleet's findings and plans as Prometheus metrics
    metrics_serve_port: int = Field(9108, ge=0, le=65535)
    metrics_serve_host: str = ""  # the address it listens on ("": every interface)
    metrics_serve_refresh_s: float = Field(30.0, gt=0)  # re-read the store at most this often

    @property
    def context_bytes(self) -> int:
        """The default C in bytes (context_mb)."""
        return self.context_mb << 20

    @property
    def host_silence_s(self) -> float:
        """How long a host may go unheard before the enforcer plans around it (host_silent_after_s, else derived)."""
        if self.host_silent_after_s is not None:
            return self.host_silent_after_s
        return min(self.command_ttl_s, max(120.0, 6 * self.flush_interval_s))

    @property
    def resolved_db_url(self) -> str:
        return self.db_url or f"sqlite:///{self.home / 'fleetlens.db'}"

    @property
    def trace_dir(self) -> Path:
        return self.home / "traces"

    @property
    def checkpoint_dir(self) -> Path:
        return self.home / "checkpoints"

    @property
    def socket_path(self) -> Path:
        return self.home / "agent.sock"

    @property
    def mps_pipe_dir(self) -> Path:
        return self.home / "mps" / "pipe"

    @property
    def mps_log_dir(self) -> Path:
        return self.home / "mps" / "log"

    @property
    def mps_dirs(self) -> tuple[Path, Path] | None:
        """(pipe, log folder) of the host's MPS daemon when the fleet runs MPS, else None."""
        return (self.mps_pipe_dir, self.mps_log_dir) if self.mps else None

    @property
    def spool_dir(self) -> Path:
        return self.home / "spool"

    def ensure_home(self) -> Path:
        """Create FLEETLENS_HOME if needed and prove it is writable."""
        try:
            self.home.mkdir(parents=True, exist_ok=True)
            probe = self.home / f".write-test-{os.getpid()}"
            probe.write_text("")
            probe.unlink()
        except OSError as exc:
            raise ConfigError(
                f"FLEETLENS_HOME {self.home} cannot be written ({exc.strerror or exc}); "
                "set FLEETLENS_HOME to a folder you can write"
            ) from None
        return self.home

    def secret_bytes(self) -> bytes:
        """The key that signs agent commands: FLEETLENS_SECRET, else a key kept in FLEETLENS_HOME/secret.

        A fleet must set FLEETLENS_SECRET to the same value on every host; one host can live with the
        generated file.
        """
        if self.secret is not None and self.secret.get_secret_value():
            return self.secret.get_secret_value().encode()
        path = self.home / "secret"
        if not path.exists():
            self.ensure_home()
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
        return path.read_text().strip().encode()


@lru_cache(maxsize=1)
def _cached() -> Settings:
    try:
        return Settings()
    except ValidationError as exc:  # a value of the wrong kind or out of range: say which variable, not a traceback
        raise ConfigError("bad setting: " + "; ".join(
            f"{_variable(str(err['loc'][0]) if err['loc'] else '?')} is {_shown(err.get('input'))}: "
            f"{err['msg'].lower()}" for err in exc.errors())) from None
    except SettingsError as exc:  # a JSON setting (a list, a renaming) that is not JSON
        field = re.search(r'field "([^"]+)"', str(exc))
        name = _variable(field.group(1)) if field else "a FLEETLENS_ variable"
        raise ConfigError(f"bad setting: {name} must be JSON ({exc.__cause__ or exc})") from None


def _variable(key: str) -> str:
    """The environment variable(s) of a settings field or alias, as the user sets them."""
    prefix = Settings.model_config.get("env_prefix", "")
    for name, info in Settings.model_fields.items():
        choices = info.validation_alias.choices if isinstance(info.validation_alias, AliasChoices) else []
        if key == name or key in choices:
            return " or ".join(str(c) for c in choices) if choices else f"{prefix}{name.upper()}"
    return key


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def get_settings(fresh: bool = False) -> Settings:
    """The process's settings. `fresh=True` re-reads the environment (tests, subcommands)."""
    if fresh:
        _cached.cache_clear()
    return _cached()
