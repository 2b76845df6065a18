"""The database goes away: samples spool to disk and arrive in full when it returns; a killed agent
loses at most one flush interval and resends its spool on restart; two hosts write to one PostgreSQL."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import event
from sqlalchemy.engine import make_url

from collector.agent import Agent
from collector.sources import open_source
from store.db import Store
from store.migrations import upgrade
from store.settings import Settings
from tests.collector.agent_helpers import Recording, TcpProxy, count_samples, sample_times, wait_for

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def real_source(settings: Settings):
    """The real cpu source: this machine's cores and the processes running on them."""
    return open_source(settings.model_copy(update={"source": "cpu"}))


@pytest.fixture
def settings(fleet_home: Path) -> Settings:
    return Settings()


def test_sqlite_unreachable_at_start_then_back(tmp_path: Path, settings: Settings):
    folder = tmp_path / "db"
    folder.mkdir()
    store = Store(f"sqlite:///{folder / 'fleetlens.db'}")
    upgrade(store)
    store.dispose()
    hidden = tmp_path / "db-away"
    folder.rename(hidden)  # the database file cannot be opened: the agent must start anyway and spool
    source = Recording(real_source(settings))
    agent = Agent(store, settings, source, host_id="h-sqlite", sample_interval_s=0.1, flush_interval_s=0.4,
                  serve_socket=False).start()
    try:
        wait_for(lambda: agent.stats.batches_spooled >= 3)
        assert agent.stats.batches_written == 0 and len(agent.spool) >= 3
        hidden.rename(folder)
        wait_for(lambda: len(agent.spool) == 0 and agent.stats.batches_written >= 1)
    finally:
        agent.stop()
    assert agent.stats.batches_resent >= 3
    assert source.ts <= set(sample_times(store, "h-sqlite"))  # every reading taken is stored
    assert count_samples(store, "h-sqlite")[0] == agent.stats.device_rows


def test_a_write_another_writer_locks_out_is_kept_and_the_database_not_taken_for_down(tmp_path: Path,
                                                                                        settings: Settings):
    store = Store(f"sqlite:///{tmp_path / 'fleetlens.db'}")
    upgrade(store)
    store.dispose()
    event.listen(store.engine, "connect", lambda conn, _: conn.execute("PRAGMA busy_timeout=0"))  # no 30 s wait
    source = Recording(real_source(settings))
    agent = Agent(store, settings, source, host_id="h-busy", sample_interval_s=0.1, flush_interval_s=0.3,
                  serve_socket=False).start()
    holder = sqlite3.connect(tmp_path / "fleetlens.db", isolation_level=None)
    try:
        wait_for(lambda: agent.stats.batches_written >= 1)
        holder.execute("BEGIN IMMEDIATE")  # another process writes and holds the database's write lock
        wait_for(lambda: agent.stats.busy_writes >= 2 and agent.stats.batches_spooled >= 2)
        assert agent._db_up is True  # not an outage: the agent does not stop polling its commands
        holder.execute("ROLLBACK")
        wait_for(lambda: len(agent.spool) == 0 and agent.stats.batches_resent >= 2)
    finally:
        holder.close()
        agent.stop()
    assert source.ts <= set(sample_times(store, "h-busy"))  # every reading taken is stored
    assert count_samples(store, "h-busy")[0] == agent.stats.device_rows


@pytest.mark.pg
@pytest.mark.slow
def test_postgres_gone_for_60_s_loses_no_sample(pg_url: str, pg_store: Store, settings: Settings):
    proxy = TcpProxy(make_url(pg_url).host or "127.0.0.1", make_url(pg_url).port or 5432).start()
    store = Store(proxy.url(pg_url), connect_timeout_s=2)
    source = Recording(real_source(settings))
    agent = Agent(store, settings, source, host_id="h-outage", sample_interval_s=0.5, flush_interval_s=2.0,
                  serve_socket=False).start()
    try:
        wait_for(lambda: agent.stats.batches_written >= 2)
        proxy.cut()
        cut_at = time.time()
        wait_for(lambda: agent.stats.batches_spooled >= 1)
        time.sleep(max(0.0, 60.0 - (time.time() - cut_at)))
        spooled = agent.stats.batches_spooled
        assert spooled >= 25 and len(agent.spool) == spooled  # ~60 s of 2 s batches, all still on disk
        proxy.restore()
        wait_for(lambda: len(agent.spool) == 0 and agent.stats.batches_resent >= spooled, timeout=60)
    finally:
        agent.stop()
        proxy.cut()
        store.dispose()
    stored = set(sample_times(pg_store, "h-outage"))
    assert source.ts <= stored, f"{len(source.ts - stored)} sample times never arrived"
    assert count_samples(pg_store, "h-outage")[0] == agent.stats.device_rows
    outage = [t for t in source.ts if cut_at + 1 < t < cut_at + 59]
    assert len(outage) > 100  # the outage window really was sampled (2 devices x 2 Hz)


def agent_process(home: Path, db_url: str, host: str, *extra: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETLENS_")}
    env.update(FLEETLENS_HOME=str(home), FLEETLENS_DB_URL=db_url, FLEETLENS_SECRET="test-secret")
    cmd = [sys.executable, "-c", "from ui.cli import main; main()", "agent", "--source", "cpu", "--host-id", host,
           "--interval", "0.2", "--flush-interval", "2", "--no-socket", *extra]
    return subprocess.Popen(cmd, cwd=PROJECT_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def assert_continuous(times: list[float], upto: float, interval: float = 0.2, flush: float = 2.0) -> None:
    """No hole as long as a flush interval between `times[0]` and `upto`: no batch was lost."""
    inside = [t for t in times if t <= upto]
    gaps = [b - a for a, b in zip(inside, inside[1:], strict=False)]
    assert inside and max(gaps) < flush * 0.75, f"a hole of {max(gaps):.2f} s: a batch was lost"


def host_registered(store: Store, host_id: str) -> bool:
    from store.models import Host

    with store.session() as s:
        return s.get(Host, host_id) is not None


@pytest.mark.pg
def test_sigkill_loses_at_most_one_flush_and_resends_the_spool(tmp_path: Path, pg_url: str, pg_store: Store):
    proxy = TcpProxy(make_url(pg_url).host or "127.0.0.1", make_url(pg_url).port or 5432).start()
    home = tmp_path / "home"
    spool_dir = home / "spool" / "h-kill"
    first = agent_process(home, proxy.url(pg_url), "h-kill")
    try:
        wait_for(lambda: len(sample_times(pg_store, "h-kill")) >= 10, timeout=60)
        proxy.cut()
        wait_for(lambda: len(list(spool_dir.glob("*.seg"))) >= 2, timeout=30)
        first.send_signal(signal.SIGKILL)
        killed_at = time.time()
        first.wait(timeout=10)
        assert first.returncode == -signal.SIGKILL
        spooled = sorted(spool_dir.glob("*.seg"))
        assert len(spooled) >= 2
        proxy.restore()
        second = agent_process(home, proxy.url(pg_url), "h-kill")
        try:
            wait_for(lambda: not list(spool_dir.glob("*.seg")) and
                     max(sample_times(pg_store, "h-kill")) > killed_at + 1, timeout=60)
        finally:
            second.send_signal(signal.SIGTERM)
            out, err = second.communicate(timeout=30)
        assert second.returncode == 128 + signal.SIGTERM, err.decode()[-2000:]
    finally:
        if first.poll() is None:
            first.kill()
        proxy.cut()
    times = sample_times(pg_store, "h-kill")
    before = [t for t in times if t < killed_at]
    # what the first agent had spooled arrived, and at most one flush interval (2 s) before the kill is missing
    assert killed_at - before[-1] <= 2.0 + 1.0
    assert_continuous(before, killed_at)


def test_sigkill_without_outage_loses_at_most_one_flush(tmp_path: Path):
    home = tmp_path / "home"
    home.mkdir()
    db = f"sqlite:///{home / 'fleetlens.db'}"
    store = Store(db)
    upgrade(store)
    agent = agent_process(home, db, "h-kill-sqlite")
    try:
        wait_for(lambda: len(sample_times(store, "h-kill-sqlite")) >= 15, timeout=60)
        time.sleep(1.0)
        agent.send_signal(signal.SIGKILL)
        killed_at = time.time()
        agent.wait(timeout=10)
    finally:
        if agent.poll() is None:
            agent.kill()
    times = sample_times(store, "h-kill-sqlite")
    assert killed_at - times[-1] <= 2.0 + 1.0
    assert_continuous(times, killed_at)
    restarted = agent_process(home, db, "h-kill-sqlite", "--duration", "1.5")
    out, err = restarted.communicate(timeout=60)
    assert restarted.returncode == 0, err.decode()[-2000:]
    assert max(sample_times(store, "h-kill-sqlite")) > killed_at  # picks up where it was, same host and devices


@pytest.mark.pg
def test_two_hosts_write_to_one_postgres_at_once(pg_url: str, pg_store: Store, tmp_path: Path):
    agents, sources = [], []
    for host in ("h-one", "h-two"):
        home = tmp_path / host
        s = Settings(home=home, host_id=host)
        src = Recording(real_source(s))  # both real: the host id keeps their device uuids apart
        sources.append(src)
        agents.append(Agent(Store(pg_url), s, src, sample_interval_s=0.2, flush_interval_s=0.5, serve_socket=False))
    for a in agents:
        a.start()
    try:
        wait_for(lambda: all(a.stats.batches_written >= 5 for a in agents), timeout=60)
    finally:
        for a in agents:
            a.stop()
    for a, src in zip(agents, sources, strict=True):
        assert src.ts <= set(sample_times(pg_store, a.host_id))
        assert count_samples(pg_store, a.host_id) == (a.stats.device_rows, a.stats.process_rows)
        a.store.dispose()


def test_clean_stop_on_sigterm_writes_the_last_batch(tmp_path: Path):
    home = tmp_path / "home"
    home.mkdir()
    db = f"sqlite:///{home / 'fleetlens.db'}"
    store = Store(db)
    upgrade(store)
    agent = agent_process(home, db, "h-term", "--flush-interval", "3600")
    try:
        wait_for(lambda: host_registered(store, "h-term"), timeout=60)  # running, its signal handlers set
        time.sleep(2.0)
        assert sample_times(store, "h-term") == []  # nothing flushed yet: one flush an hour
        agent.send_signal(signal.SIGTERM)
        out, err = agent.communicate(timeout=30)
    finally:
        if agent.poll() is None:
            agent.kill()
    assert agent.returncode == 128 + signal.SIGTERM, err.decode()[-2000:]
    assert len(sample_times(store, "h-term")) >= 3
    assert b"stopped after" in out
    assert not (home / "spool" / "h-term").exists() or not list((home / "spool" / "h-term").glob("*.seg"))


