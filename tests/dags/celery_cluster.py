"""A whole Airflow deployment on its Celery executor, started as real processes for one test and stopped after it.

Redis at 127.0.0.1:6379 is the broker (a queue named for this run, so nothing else on that Redis collides), a
PostgreSQL database made for this run holds Airflow's metadata and Celery's results, and the scheduler, the DAG
processor, the API server and the Celery workers each run in their own process group with their own AIRFLOW_HOME.
Every process carries RUN_MARK in its environment: after the stop, none may be left, whatever its command line.
Each worker reports its own hostname to Airflow (its `hostname_callable`), as two machines would.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import redis
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url

from tests.conftest import PROJECT_ROOT
from tests.procs import kill_all

AIRFLOW = Path(sys.executable).with_name("airflow")
RUN_MARK = "FLEETLENS_TEST_CELERY_RUN"
REDIS_DB = 11  # a database of its own on the shared Redis; the per-run queue name keeps runs apart inside it


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def marked(mark: str, home: str | None = None) -> list[psutil.Process]:
    """Processes whose environment carries this run's mark (and, given `home`, that AIRFLOW_HOME: one component's)."""
    found = []
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
        except psutil.Error:
            continue
        if env.get(RUN_MARK) == mark and (home is None or env.get("AIRFLOW_HOME") == home):
            found.append(proc)
    return found


@dataclass
class CeleryCluster:
    root: Path
    pg_base: str  # the PostgreSQL server's URL (any database on it)
    fleetlens_db_url: str
    fleetlens_env: dict[str, str] = field(default_factory=dict)
    mark: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)  # running components
    killed: dict[str, subprocess.Popen] = field(default_factory=dict)  # components killed on purpose

    def __post_init__(self) -> None:
        self.database = f"fl_airflow_{self.mark}"
        self.queue = f"fleetlens-test-{self.mark}"
        self.port = free_port()
        base = make_url(self.pg_base).set(drivername="postgresql+psycopg", query={})
        self._admin = create_engine(base, isolation_level="AUTOCOMMIT")
        self.airflow_url = base.set(database=self.database)
        self.metadata: Engine | None = None

    # -- environment -------------------------------------------------------------------------------------------

    def env(self, name: str, extra_path: Path | None = None, **more: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "FLEETLENS_"))}
        conn = self.airflow_url.render_as_string(hide_password=False)
        home = self.root / name
        home.mkdir(parents=True, exist_ok=True)
        env.update({
            RUN_MARK: self.mark,
            "PYTHONPATH": os.pathsep.join(str(p) for p in (PROJECT_ROOT, extra_path) if p),
            "AIRFLOW_HOME": self.env_home(name),
            "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
            "AIRFLOW__CORE__DAGS_FOLDER": str(PROJECT_ROOT / "dags"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "True",
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{self.port}/execution/",
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": conn,
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN_ASYNC": conn.replace("+psycopg://", "+psycopg_async://"),
            "AIRFLOW__CELERY__BROKER_URL": f"redis://127.0.0.1:6379/{REDIS_DB}",
            "AIRFLOW__CELERY__RESULT_BACKEND": "db+" + conn,
            "AIRFLOW__CELERY__WORKER_CONCURRENCY": "1",
            "AIRFLOW__OPERATORS__DEFAULT_QUEUE": self.queue,
            "AIRFLOW__API__PORT": str(self.port),
            "AIRFLOW__API__SECRET_KEY": f"secret-{self.mark}",
            "AIRFLOW__API_AUTH__JWT_SECRET": f"jwt-{self.mark}",
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
            "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": "30",
            # only the run the test triggers: a scheduled run made on unpause would take the traces first
            "AIRFLOW__SCHEDULER__USE_JOB_SCHEDULE": "False",
            "FLEETLENS_HOME": str(home / "fleetlens"),
            "FLEETLENS_DB_URL": self.fleetlens_db_url,
            **self.fleetlens_env,
        })
        env.update(more)
        return env

    def airflow(self, *args: str, timeout: float = 300) -> str:
        """Run one `airflow` command to its end (CLI work on the metadata database)."""
        proc = subprocess.run([str(AIRFLOW), *args], env=self.env("cli"), capture_output=True, text=True,
                              timeout=timeout, start_new_session=True)
        assert proc.returncode == 0, f"airflow {' '.join(args)}: {proc.stdout[-3000:]}{proc.stderr[-3000:]}"
        return proc.stdout

    # -- life cycle --------------------------------------------------------------------------------------------

    def create(self) -> None:
        with self._admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{self.database}"'))
        self.metadata = create_engine(self.airflow_url, pool_pre_ping=True)
        self.airflow("db", "migrate", timeout=600)

    def start(self, name: str, *args: str, extra_path: Path | None = None, **env: str) -> None:
        log = open(self.root / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process group
        self.procs[name] = subprocess.Popen([str(AIRFLOW), *args], env=self.env(name, extra_path, **env),
                                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

    def start_worker(self, name: str) -> None:
        """A Celery worker that tells Airflow it is host `name`."""
        mod = self.root / name / "hostmod"
        mod.mkdir(parents=True, exist_ok=True)
        (mod / "fleetlens_test_hostname.py").write_text(f"def hostname():\n    return {name!r}\n")
        self.start(name, "celery", "worker", "--concurrency", "1", "--celery-hostname", f"{name}@%h",
                   "--queues", self.queue, "--skip-serve-logs", "--without-mingle", "--without-gossip",
                   extra_path=mod, AIRFLOW__CORE__HOSTNAME_CALLABLE="fleetlens_test_hostname.hostname")

    def log(self, name: str) -> str:
        path = self.root / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def logs_tail(self, chars: int = 1500) -> str:
        return "\n".join(f"--- {n} ---\n{self.log(n)[-chars:]}" for n in [*self.procs, *self.killed])

    def wait(self, what: str, check: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                assert proc.poll() is None, f"{name} exited ({proc.returncode}) while waiting for {what}\n" + \
                    self.logs_tail()
            if check():
                return
            time.sleep(1.0)
        raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{self.logs_tail()}")

    def query(self, sql: str, **params) -> list:
        assert self.metadata is not None
        with self.metadata.connect() as conn:
            return list(conn.execute(text(sql), params).all())

    def kill(self, name: str) -> None:
        """SIGKILL one component and every process it started (a machine lost, not a shutdown): its process group,
        and what left that group, such as the process a Celery worker runs a task in (Airflow's supervisor puts it in
        a group of its own), which would otherwise finish the task's work unseen. Those are found as descendants
        (read while the tree stands) and by environment (setproctitle may overwrite what /proc shows of it)."""
        proc = self.procs.pop(name)
        self.killed[name] = proc
        home = self.env_home(name)
        try:
            members = psutil.Process(proc.pid).children(recursive=True)
        except psutil.Error:
            members = []
        members += [p for p in marked(self.mark, home) if p not in members]
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + 30
        while members:
            kill_all(members, timeout=5)
            assert time.monotonic() < deadline, f"{name}: processes survive SIGKILL: {members}"
            members = [p for p in marked(self.mark, home) if p.is_running()]  # forked before it died
        proc.wait(timeout=30)

    def env_home(self, name: str) -> str:
        """The AIRFLOW_HOME component `name` runs with (and every process it starts inherits)."""
        return str(self.root / name / "airflow")

    def stop(self) -> list[str]:
        """Stop every process group, then anything else carrying this run's mark; returns what was left over after
        the groups were stopped (described), which a clean stop leaves empty."""
        for proc in [*self.procs.values(), *self.killed.values()]:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 20
        for proc in [*self.procs.values(), *self.killed.values()]:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=30)
        left = marked(self.mark)
        described = []
        for p in left:
            try:
                described.append(f"{p.pid} {' '.join(p.cmdline())[:100]}")
                p.kill()
            except psutil.Error:
                continue
        psutil.wait_procs(left, timeout=10)
        return described

    def drop(self) -> None:
        if self.metadata is not None:
            self.metadata.dispose()
        with self._admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{self.database}" WITH (FORCE)'))
        self._admin.dispose()
        client = redis.Redis(host="127.0.0.1", port=6379, db=REDIS_DB)
        try:
            keys = list(client.scan_iter(match=f"*{self.queue}*"))
            if keys:
                client.delete(*keys)
            # messages a killed worker held (acks_late) wait in kombu's shared 'unacked' hash: drop this run's
            unacked = [tag for tag, msg in client.hscan_iter("unacked") if self.queue.encode() in msg]
            if unacked:
                client.hdel("unacked", *unacked)
                client.zrem("unacked_index", *unacked)
        finally:
            client.close()
