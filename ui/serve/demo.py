"""`fleetlens demo`: the whole loop on one machine, from a replayed real fleet to a job moved and resumed.

It replays the Alibaba GenAI fleet's GPU telemetry as virtual hosts, starts a local agent (NVML on a GPU host,
the `cpu` source otherwise), launches four managed PyTorch jobs (healthy, input-bound, idle memory holder,
tiny steps), profiles each on demand and analyses the traces and the telemetry, plans PACK consolidation and
applies it to the local jobs by checkpoint and relaunch, then prints a summary and serves the dashboard.

Everything the demo starts runs with FLEETLENS_HOME set to the demo's own folder; on exit (the end of
`--duration`, SIGINT, SIGTERM, or an error) every process carrying that folder in its environment is stopped
(SIGTERM, SIGKILL after a grace for the jobs' checkpoints) within STOP_BUDGET_S, and the demo looks again: a
process still alive is named in the report and on the console.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from sqlalchemy import func, select

from analyzer.ranking import rank_with_waste
from analyzer.rollups import rollup
from analyzer.telemetry import detect
from analyzer.telemetry.thresholds import Thresholds, load_thresholds, scaled
from analyzer.traces import analyze_pending
from analyzer.traces.cache import TraceBounds
from analyzer.traces.claims import ClaimPolicy
from collector.recordings.load import load_into_store
from enforcer.actuators.drive import drive_actions
from enforcer.plan_store import apply_plan, make_plan
from store.db import Store
from store.errors import FleetlensError
from store.findings import open_findings
from store.migrations import upgrade
from store.models import Action, Device, Placement, ProfileRequest, StepStat, Trace
from store.profiling import request_profile
from store.settings import Settings, get_settings
from ui.serve.processes import Children, Signals, describe, fleetlens_command, stop_processes_of
from ui.serve.run import run_managed

# The four local jobs: (name, train.py mode, placement group). Jobs of the same group start on the same device,
# so consolidation has a whole device to give back: the input-bound job and the idle holder share one.
JOBS: tuple[tuple[str, str, int], ...] = (
    ("healthy", "healthy", 0),
    ("tiny-steps", "tiny", 0),
    ("input-bound", "input-bound", 1),
    ("idle-holder", "idle-holder", 1),
)
PROFILE_STEPS = 5
HEALTHY_MEMORY_SHARE = 0.3  # above memory_overprovisioned's 25 %
OBSERVE_MARGIN_S = 8.0
HEALTHY_HIDDEN = 1024
RUNTIME_MEMORY = 512 * 2**20  # what the interpreter and torch take besides a job's tensors
IDLE_HOLD_MB = 256  # what collector.examples.train's idle holder keeps allocated by default
# Expected utilisation alone, as an owner would declare it: PACK only packs jobs whose slowdown stays capped.
UTIL = {"healthy": 0.9, "tiny": 0.5, "input-bound": 0.2, "idle-holder": 0.05}


class DemoError(FleetlensError):
    """A demo step that could not be done (no agent, a job that never started)."""


def check_port_free(port: int) -> None:
    """Raise DemoError when another process listens on `port`, where the dashboard (on every interface) would."""
    if not 0 < port < 65536:
        raise DemoError(f"--port {port} is not a TCP port; use 1..65535")
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed connection's TIME_WAIT is no holder
        try:
            probe.bind(("", port))
        except OSError as exc:
            raise DemoError(f"port {port} is in use ({exc.strerror}): another dashboard, an earlier demo's perhaps, "
                            f"would answer there. Stop it, or give the demo another port: `fleetlens demo --port N` "
                            f"(`FLEETLENS_UI_PORT=N make demo`)") from None


@dataclass
class DemoReport:
    home: str
    db_url: str
    fleet: dict[str, Any] = field(default_factory=dict)
    jobs: dict[str, dict[str, Any]] = field(default_factory=dict)
    traces: dict[str, Any] = field(default_factory=dict)
    findings_by_rule: dict[str, int] = field(default_factory=dict)
    fleet_flagged: int = 0
    gpu_hours_recoverable_per_day: float = 0.0
    gpu_hours_held_per_day: float = 0.0
    waste_notes: list[str] = field(default_factory=list)
    plan: dict[str, Any] = field(default_factory=dict)
    migrations: dict[str, str] = field(default_factory=dict)
    devices_freed: int = 0
    dashboard: str | None = None
    steps_failed: list[str] = field(default_factory=list)
    survivors: list[str] = field(default_factory=list)  # processes of the demo still alive after the stop


@dataclass
class DemoOptions:
    home: Path
    duration: float | None = None  # None: run until Ctrl-C
    ui: bool = True
    speedup: float = 120.0  # demo time: detector durations (30 min idle, ...) shrink by this factor
    steps: int = 1_000_000  # the jobs train until the demo ends
    port: int = 8501
    console: Console = field(default_factory=Console)


class Demo:
    def __init__(self, options: DemoOptions, signals: Signals | None = None) -> None:
        self.o = options
        self.signals = signals or Signals()
        self.console = options.console
        self.home = options.home.expanduser().resolve()
        self.t0 = time.monotonic()
        self.report = DemoReport(home=str(self.home), db_url=f"sqlite:///{self.home / 'fleetlens.db'}")
        self.workflows: dict[str, str] = {}  # demo job name -> workflow id

    # ---- the run ------------------------------------------------------------------------------------------

    def run(self) -> DemoReport:
        if self.o.ui:  # before any work: a dashboard port another process holds would show that process's pages
            check_port_free(self.o.port)
        self.prepare()
        try:
            self.start_agent()
            self.launch_jobs()
            # a daemon: a stop mid-load must not wait for the load (the demo's own store, abandoned with the demo)
            loader = threading.Thread(target=self.step, name="fleet-load", daemon=True,
                                      args=("replayed the Alibaba GenAI fleet's telemetry", self.load_fleet))
            loader.start()  # ~10-20 s of bulk writes, while the jobs warm up
            self.step("waiting for the jobs' first steps", self.wait_for_steps)
            self.step("profiling each job on demand", self.profile_jobs)
            self.step("letting the jobs run for a while of demo time", self.observe)
            loader.join()
            self.step("analysing traces and telemetry", self.analyze)
            self.step("planning and applying PACK consolidation", self.consolidate)
            self.write_report()
            self.print_summary()
            if self.o.ui:
                self.step("starting the dashboard", self.serve_ui)
            self.wait_until_end()
        finally:
            with self.signals.shielded():  # a signal now (a second Ctrl-C) must not cut the stop short
                self.stop_everything()
        return self.report

    def step(self, title: str, fn: Callable[[], None]) -> None:
        with self.console.status(f"[bold]{title}…"):
            started = time.monotonic()
            try:
                fn()
            except FleetlensError as exc:
                self.report.steps_failed.append(f"{title}: {exc}")
                self.console.print(f"[red]✗[/] {title}: {exc}")
                return
        self.console.print(f"[green]✓[/] {title} [dim]({time.monotonic() - started:.0f} s, "
                           f"t+{self.elapsed():.0f} s)[/]")

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    # ---- set-up -------------------------------------------------------------------------------------------

    def prepare(self) -> None:
        """A fresh demo folder and store; children inherit the environment that points at it."""
        if self.home.exists():
            stop_processes_of(self.home)  # an earlier demo that was killed hard
            shutil.rmtree(self.home)
        self.home.mkdir(parents=True)
        self.children = Children(self.home)
        env = {
            "FLEETLENS_HOME": str(self.home),
            "FLEETLENS_DB_URL": self.report.db_url,
            "FLEETLENS_HOST_ID": socket.gethostname(),
            "FLEETLENS_SAMPLE_INTERVAL_S": "1",
            "FLEETLENS_FLUSH_INTERVAL_S": "2",
            "FLEETLENS_POLICY": "pack",
            "FLEETLENS_COOLDOWN_S": "0",
            "FLEETLENS_UI_PORT": str(self.o.port),
        }
        os.environ.update(env)  # the demo is an entry point: its children and this process share one config
        self.settings: Settings = get_settings(fresh=True)
        self.settings.ensure_home()
        self.store = Store(self.report.db_url)
        upgrade(self.store)
        self.console.print(f"[green]✓[/] demo store {self.report.db_url}")

    def start_agent(self) -> None:
        agent = self.children.spawn(fleetlens_command("agent"), "agent.log")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if agent.poll() is not None:
                raise DemoError(f"the agent exited at start; see {self.home / 'agent.log'}")
            with self.store.session() as s:
                n = s.scalar(select(func.count()).select_from(Device).where(Device.host_id == self.settings.host_id))
            if n:
                self.console.print(f"[green]✓[/] local agent up: {n} device(s) on {self.settings.host_id}")
                return
            time.sleep(0.5)
        raise DemoError(f"the agent registered no device within 60 s; see {self.home / 'agent.log'}")

    def launch_jobs(self) -> None:
        with self.store.session() as s:
            devices = list(s.scalars(select(Device).where(Device.host_id == self.settings.host_id)
                                     .order_by(Device.index)))
        for name, mode, group in JOBS:
            device = devices[min(group, len(devices) - 1)]
            command = [sys.executable, "-m", "collector.examples.train", "--mode", mode, "--steps",
                       str(self.o.steps), "--name", name]
            # every job declares its memory, as an owner would: a job of unknown memory would get a device alone
            declared = RUNTIME_MEMORY + (IDLE_HOLD_MB << 20 if mode == "idle-holder" else 0)
            if mode == "healthy" and device.memory_total:
                # a healthy job uses its device's memory too, so it is no lane candidate; its owner declares it
                hold = int(device.memory_total * HEALTHY_MEMORY_SHARE)
                # and real work per step, so fetching a batch is a small part of it (under 10 %)
                command += ["--hold-mb", str(hold // 2**20), "--hidden", str(HEALTHY_HIDDEN)]
                declared = hold + RUNTIME_MEMORY
            job, _ = run_managed(self.store, command, detach=True, settings=self.settings, lane="auto",
                                 movable=True, team="demo", steps=self.o.steps, name=name, devices=[device.id],
                                 util=UTIL[mode], mem_bytes=declared)
            self.workflows[name] = job.workflow_id
            self.report.jobs[name] = {"workflow": job.workflow_id, "mode": mode, "device": device.id}
            self.console.print(f"[green]✓[/] started {name} ({mode}) as {job.workflow_id} on device {device.id}")

    def load_fleet(self) -> None:
        summary = load_into_store(self.store, "alibaba", fleet_data_dir=self.settings.fleet_data_dir)
        self.report.fleet = {"hosts": summary.hosts, "devices": summary.devices, "workflows": summary.workflows,
                             "device_samples": summary.device_samples, "skipped_rows": summary.skipped_rows}

    # ---- the loop -----------------------------------------------------------------------------------------

    def wait_for_steps(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        waiting = set(self.workflows.values())
        while waiting and time.monotonic() < deadline:
            with self.store.session() as s:
                seen = set(s.scalars(select(StepStat.workflow_id).where(StepStat.workflow_id.in_(waiting))))
            waiting -= seen
            time.sleep(0.5)
        if waiting:
            raise DemoError(f"no steps reported within {timeout_s:.0f} s by {sorted(waiting)}")
        self.training_since = time.time()

    def observe(self) -> None:
        """Wait until the jobs have trained for the detectors' longest duration, in demo time."""
        th = self.demo_thresholds()
        needed = max(th.idle_holder.min_duration_s, th.low_utilization.min_held_s) + OBSERVE_MARGIN_S
        time.sleep(max(0.0, self.training_since + needed - time.time()))

    def profile_jobs(self, timeout_s: float = 120.0) -> None:
        with self.store.session() as s:
            requests = {name: request_profile(s, wf, PROFILE_STEPS, requested_by="demo").id
                        for name, wf in self.workflows.items()}
        deadline = time.monotonic() + timeout_s
        pending = dict(requests)
        while pending and time.monotonic() < deadline:
            with self.store.session() as s:
                for name, rid in list(pending.items()):
                    request = s.get(ProfileRequest, rid)
                    if request.status in ("done", "failed", "expired"):
                        traces = s.scalars(select(Trace.path).where(Trace.profile_request_id == rid)).all()
                        self.report.traces[name] = {"status": request.status, "paths": list(traces),
                                                    "error": request.error}
                        del pending[name]
            time.sleep(0.5)
        for name in pending:
            self.report.traces[name] = {"status": "timed out", "paths": []}
        if any(t["status"] != "done" for t in self.report.traces.values()):
            raise DemoError("not every job was profiled: " + ", ".join(
                f"{n}: {t['status']}" for n, t in self.report.traces.items() if t["status"] != "done"))

    def analyze(self) -> None:
        analyze_pending(self.store, cache_dir=self.settings.home / "cache" / "traces", host_id=self.settings.host_id,
                        bounds=TraceBounds.from_settings(self.settings),
                        claims=ClaimPolicy.from_settings(self.settings))
        # The replayed fleet is judged on real time; the local jobs, a minute or two old, on demo time.
        detect(self.store)
        # judged from their first step on: a start-up (imports, allocation) is no part of how a job uses a device
        detect(self.store, window_s=time.time() - self.training_since, thresholds=self.demo_thresholds(),
               workflows=sorted(self.workflows.values()))
        rollup(self.store)
        with self.store.session() as s:
            found = open_findings(s)
            by_rule: dict[str, int] = {}
            for f in found:
                by_rule[f.rule] = by_rule.get(f.rule, 0) + 1
            self.report.findings_by_rule = dict(sorted(by_rule.items()))
            local = set(self.workflows.values())
            self.report.fleet_flagged = len({f.workflow_id for f in found if f.workflow_id not in local})
            for name, wf in self.workflows.items():
                self.report.jobs[name]["findings"] = sorted({f.rule for f in found if f.workflow_id == wf})
        # the one waste function: overlapping findings counted once, bounded by the GPU-hours held
        _, w = rank_with_waste(self.store)
        self.report.gpu_hours_recoverable_per_day = round(w.recoverable_gpu_hours_per_day, 1)
        self.report.gpu_hours_held_per_day = round(w.held_gpu_hours_per_day, 1)
        self.report.waste_notes = [*w.assumptions, *w.problems]

    def demo_thresholds(self) -> Thresholds:
        return scaled(load_thresholds(), 1.0 / self.o.speedup)

    def consolidate(self) -> None:
        plan = make_plan(self.store, "pack", settings=self.settings)
        local = set(self.workflows.values())
        moves = [m for m in plan.moves if m.workflow_id in local]
        self.report.plan = {"id": plan.plan_id, "moves": len(plan.moves), "local_moves": len(moves),
                            "devices_freed_planned": len(plan.devices_freed)}
        if not plan.moves:
            raise DemoError("the PACK plan has no moves (no local device is wholly idle or underused)")
        actions = apply_plan(self.store, plan.plan_id, settings=self.settings)
        states = drive_actions(self.store, action_ids=[a.id for a in actions], settings=self.settings, timeout_s=180)
        with self.store.session() as s:
            for action_id, state in states.items():
                self.report.migrations[s.get(Action, action_id).workflow_id] = state
            busy = set(s.scalars(select(Placement.device_id).where(Placement.state.in_(("active", "pending")))))
        freed = [d for d in plan.devices_freed if d not in busy]
        self.report.devices_freed = len(freed) if all(st == "resumed" for st in states.values()) else 0

    def serve_ui(self) -> None:
        dashboard = self.children.spawn(fleetlens_command("ui", "--port", str(self.o.port)), "dashboard.log")
        url = f"http://127.0.0.1:{self.o.port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if dashboard.poll() is not None:  # whatever answers on the port now is not this demo's dashboard
                raise DemoError(f"the dashboard exited at start; see {self.home / 'dashboard.log'}")
            try:
                with socket.create_connection(("127.0.0.1", self.o.port), timeout=1):
                    self.report.dashboard = url
                    self.console.print(f"[green]✓[/] dashboard at [bold]{url}[/]")
                    return
            except OSError:
                time.sleep(0.5)
        raise DemoError(f"the dashboard did not start; see {self.home / 'dashboard.log'}")

    def wait_until_end(self) -> None:
        if self.o.duration is None:
            self.console.print("running until Ctrl-C")
            while True:
                time.sleep(1)
        remaining = self.o.duration - self.elapsed()
        if remaining > 0:
            self.console.print(f"running {remaining:.0f} s more (--duration {self.o.duration:.0f})")
            time.sleep(remaining)

    # ---- the end ------------------------------------------------------------------------------------------

    def write_report(self) -> None:
        (self.home / "demo-summary.json").write_text(json.dumps(asdict(self.report), indent=2))

    def print_summary(self) -> None:
        r = self.report
        table = Table(title="fleetlens demo", show_header=False)
        table.add_row("replayed fleet", f"{r.fleet.get('workflows', 0)} containers on {r.fleet.get('devices', 0)} "
                                        f"devices; {r.fleet_flagged} flagged")
        table.add_row("findings by rule", ", ".join(f"{k} {v}" for k, v in r.findings_by_rule.items()) or "none")
        table.add_row("GPU-hours recoverable / day", f"{r.gpu_hours_recoverable_per_day:,.1f} of "
                      f"{r.gpu_hours_held_per_day:,.1f} held (overlapping findings counted once)")
        for name, job in r.jobs.items():
            table.add_row(f"job {name}", f"{job['workflow']}: {', '.join(job.get('findings', [])) or 'no findings'}")
        table.add_row("migrations", ", ".join(f"{wf} {st}" for wf, st in r.migrations.items()) or "none")
        table.add_row("devices freed", str(r.devices_freed))
        table.add_row("where to look", "`fleetlens findings`, `fleetlens lanes`, the dashboard"
                      + (f" ({r.dashboard})" if r.dashboard else f" (`fleetlens ui` with FLEETLENS_HOME={r.home})"))
        if r.steps_failed:
            table.add_row("[red]not done[/]", "\n".join(r.steps_failed))
        self.console.print(table)

    def stop_everything(self) -> None:
        """Stop the agent, the jobs it launched and the dashboard together, then look again for any of them."""
        if hasattr(self, "children"):
            self.children.terminate()  # their sessions: a dashboard's own children too
        # by environment: the jobs live in sessions of their own, and an agent may relaunch one while stopping
        survivors = stop_processes_of(self.home)
        if hasattr(self, "children"):
            self.children.stop(grace_s=0.5)  # reaps them (all gone by now, or named below)
        self.report.survivors = [describe(p) for p in survivors]
        for line in self.report.survivors:
            self.console.print(f"[red]still running after the stop:[/] {line}")
        if self.home.is_dir():
            self.write_report()
