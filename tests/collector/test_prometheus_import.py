"""`fleetlens import-prometheus` against a real Prometheus backfilled with dcgm-exporter series written here.

The series: host gpu-a GPU 0 used by pod train-a (namespace vision) for an hour, with a ten-minute scrape gap and an
ECC counter that resets; a MIG instance (GPU 1, GPU_I_ID 3) with only DCGM_FI_PROF_GR_ENGINE_ACTIVE; host gpu-b GPU 0
running Slurm job 42 (dcgm-exporter's hpc_job label); and one series without any GPU label.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
from sqlalchemy import func, select, text
from sqlalchemy.engine import make_url

from collector.importers.dcgm_labels import MIG_INDEX_BASE, PID_BASE
from collector.importers.prometheus import ImportRunning, import_from_settings, import_prometheus
from store import late_hours
from store.db import Store
from store.errors import DatabaseUnavailable, InvalidInput, UpstreamUnavailable
from store.migrations import upgrade
from store.models import Device, DeviceSample, Host, Process, ProcessSample, Workflow
from store.registry import DeviceSpec, register_devices, register_host
from store.run_locks import single_run
from store.settings import Settings
from tests.collector.agent_helpers import TcpProxy
from tests.prometheus_server import PrometheusServer, free_port, recorded_prometheus
from ui.cli import run as cli

T0 = 1_699_999_980.0  # on the step grid (a multiple of 60 s)
STEP = 60.0
N = 60  # one scrape a minute for an hour
GAP = range(20, 30)  # no scrapes of gpu-a:0 in minutes 20..29
END = T0 + (N - 1) * STEP
MIB = 1 << 20


def _ecc(i: int) -> int:
    return i // 10 if i < 40 else (i - 40) // 10  # rises to 3, then the driver reloads and it starts at 0


def _xid(i: int) -> int:
    return 79 if 10 <= i < 30 or i >= 40 else 0  # the last XID's code: 79 twice (the GPU fell off the bus)


def _openmetrics(t0: float = T0) -> str:
    """The series of the module's doc, starting at `t0`."""
    a0 = 'Hostname="gpu-a",gpu="0",UUID="GPU-aaaa",device="nvidia0",modelName="NVIDIA H100 80GB HBM3"'
    a0 += ',namespace="vision",pod="train-a",container="main"'
    mig = 'Hostname="gpu-a",gpu="1",UUID="GPU-bbbb",device="nvidia1",modelName="NVIDIA A100-SXM4-80GB",' \
          'GPU_I_ID="3",GPU_I_PROFILE="1g.10gb"'
    b0 = 'Hostname="gpu-b",gpu="0",UUID="GPU-cccc",device="nvidia0",modelName="NVIDIA A100-SXM4-80GB",hpc_job="42"'
    lines = []

    def family(name: str, kind: str, rows: list[tuple[str, float, float]]) -> None:
        lines.append(f"# TYPE {name} {kind}")
        for labels, ts, value in rows:
            lines.append(f"{name}{{{labels}}} {value!r} {ts!r}")

    a_times = [(i, t0 + i * STEP) for i in range(N) if i not in GAP]
    family("DCGM_FI_DEV_GPU_UTIL", "gauge", [(a0, t, float(i % 7) * 10) for i, t in a_times]
           + [(b0, t0 + i * STEP, 95.0) for i in range(N)]
           + [('Hostname="gpu-a",job="dcgm"', t0 + i * STEP, 1.0) for i in range(N)])  # no GPU label
    family("DCGM_FI_DEV_FB_USED", "gauge", [(a0, t, 1000.0 + i) for i, t in a_times]
           + [(mig, t0 + i * STEP, 2048.0) for i in range(N)] + [(b0, t0 + i * STEP, 70000.0) for i in range(N)])
    family("DCGM_FI_DEV_FB_FREE", "gauge", [(a0, t, 81559.0 - 1000.0 - i) for i, t in a_times]
           + [(mig, t0 + i * STEP, 9728.0 - 2048.0) for i in range(N)]
           + [(b0, t0 + i * STEP, 81920.0 - 70000.0) for i in range(N)])
    family("DCGM_FI_DEV_POWER_USAGE", "gauge", [(a0, t, 300.0) for _, t in a_times])
    family("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "gauge", [(mig, t0 + i * STEP, 0.25) for i in range(N)])
    # dcgm-exporter's name keeps the field's upper-case _TOTAL, which an OpenMetrics counter cannot have
    family("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "unknown", [(a0, t, float(_ecc(i))) for i, t in a_times])
    family("DCGM_FI_DEV_XID_ERRORS", "gauge", [(b0, t0 + i * STEP, float(_xid(i))) for i in range(N)])
    lines.append("# EOF")
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def prom(tmp_path_factory) -> Iterator[PrometheusServer]:
    folder = tmp_path_factory.mktemp("prometheus")
    with recorded_prometheus(folder, _openmetrics()) as server:
        yield server


@pytest.fixture
def store(sqlite_store: Store) -> Store:
    return sqlite_store


def _settings(**kw) -> Settings:
    return Settings(home=Path("/nonexistent"), **kw)


def _import(store: Store, url: str, **kw):
    kw.setdefault("since", T0)
    kw.setdefault("until", END)
    return import_prometheus(store, url, step=STEP, settings=kw.pop("settings", _settings()), now=END + 60, **kw)


def _counts(store: Store) -> tuple[int, int, int, int, int]:
    with store.session() as s:
        return tuple(s.scalar(select(func.count()).select_from(m))  # type: ignore[return-value]
                     for m in (Host, Device, Workflow, DeviceSample, ProcessSample))


def test_labels_become_hosts_devices_and_workflows(prom, store):
    summary = _import(store, prom.url, settings=_settings(prometheus_teams={"vision": "perception"}))
    assert summary.skipped == {"without a gpu or UUID label": 1}
    with store.session() as s:
        devices = {(d.host_id, d.index): d for d in s.scalars(select(Device))}
        assert set(devices) == {("gpu-a", 0), ("gpu-a", (1 + 1) * MIG_INDEX_BASE + 3), ("gpu-b", 0)}
        mig = devices[("gpu-a", 2 * MIG_INDEX_BASE + 3)]
        assert (mig.uuid, mig.name, mig.memory_total) == ("GPU-bbbb/gi3", "NVIDIA A100-SXM4-80GB MIG 1g.10gb",
                                                          9728 * MIB)
        assert devices[("gpu-a", 0)].memory_total == 81559 * MIB
        assert {h.id: h.source for h in s.scalars(select(Host))} == {"gpu-a": "prometheus", "gpu-b": "prometheus"}
        wfs = {w.id: w for w in s.scalars(select(Workflow))}
        assert set(wfs) == {"k8s-vision/train-a", "slurm-42"}  # the MIG instance has no user
        pod = wfs["k8s-vision/train-a"]
        assert (pod.id_source, pod.team, pod.labels["pod"], pod.labels["namespace"]) == (
            "k8s", "perception", "train-a", "vision")  # the team label renamed by the mapping
        assert wfs["slurm-42"].id_source == "slurm"
        proc = s.scalars(select(Process).where(Process.workflow_id == "slurm-42")).one()
        assert proc.pid >= PID_BASE and proc.host_id == "gpu-b"
        # MIG: utilisation from the graphics engine, memory from its own framebuffer
        util, used = s.execute(select(DeviceSample.gpu_util, DeviceSample.mem_used)
                               .where(DeviceSample.device_id == mig.id).limit(1)).one()
        assert (util, used) == (0.25, 2048 * MIB)
        # units: % -> fraction, MiB -> bytes; one process sample per device sample of a used GPU
        rows = s.execute(select(DeviceSample.ts, DeviceSample.gpu_util, DeviceSample.mem_used, DeviceSample.power_w)
                         .where(DeviceSample.device_id == devices[("gpu-a", 0)].id).order_by(DeviceSample.ts)).all()
        n_pod = s.scalar(select(func.count()).select_from(ProcessSample)
                         .where(ProcessSample.workflow_id == "k8s-vision/train-a"))
    assert rows[3][1:] == (pytest.approx(0.3), (1000 + 3) * MIB, 300.0)
    assert n_pod == len(rows)


def test_gaps_stay_gaps(prom, store):
    _import(store, prom.url)
    with store.session() as s:
        dev = s.scalar(select(Device.id).where(Device.host_id == "gpu-a", Device.index == 0))
        times = [t for (t,) in s.execute(select(DeviceSample.ts).where(DeviceSample.device_id == dev)
                                         .order_by(DeviceSample.ts))]
    assert len(times) == N - len(GAP)
    assert not [t for t in times if T0 + GAP.start * STEP <= t < T0 + GAP.stop * STEP]


def test_a_counter_reset_keeps_the_count_rising(prom, store):
    summary = _import(store, prom.url)
    assert summary.counter_resets == 1
    with store.session() as s:
        dev = s.scalar(select(Device.id).where(Device.host_id == "gpu-a", Device.index == 0))
        ecc = [e for (e,) in s.execute(select(DeviceSample.ecc_errors).where(DeviceSample.device_id == dev)
                                       .order_by(DeviceSample.ts))]
    assert ecc == sorted(ecc) and ecc[-1] == 3 + _ecc(N - 1)


def test_xid_codes_become_a_count_of_events(prom, store):
    _import(store, prom.url, until=T0 + 35 * STEP)
    _import(store, prom.url, since=None)  # the count carries on from the stored one
    with store.session() as s:
        dev = s.scalar(select(Device.id).where(Device.host_id == "gpu-b", Device.index == 0))
        xid = [x for (x,) in s.execute(select(DeviceSample.xid_errors).where(DeviceSample.device_id == dev)
                                       .order_by(DeviceSample.ts))]
    assert xid == [0] * 10 + [1] * 30 + [2] * 20


def test_import_resumes_and_never_writes_twice(prom, any_store, tmp_path):
    store = any_store
    mid = T0 + 45 * STEP  # after the reset, so the counter must carry on across the two runs
    first = _import(store, prom.url, until=mid)
    second = _import(store, prom.url, since=None)  # resumes at each device's last sample
    again = _import(store, prom.url)  # the whole range once more
    assert first.device_samples > 0 and second.device_samples > 0
    assert (again.device_samples, again.process_samples) == (0, 0)
    whole = Store(f"sqlite:///{tmp_path / 'whole.db'}")
    upgrade(whole)
    try:
        # in windows of 25 minutes (the counter reset and the XID codes fall across their edges)
        _import(whole, prom.url, settings=_settings(prometheus_window_s=1500))
        assert _counts(store) == _counts(whole)

        def ecc(st: Store) -> list:
            with st.session() as s:
                return list(s.execute(select(Device.host_id, Device.index, DeviceSample.ts, DeviceSample.ecc_errors,
                                             DeviceSample.xid_errors)
                                      .join(Device, Device.id == DeviceSample.device_id)
                                      .order_by(Device.host_id, Device.index, DeviceSample.ts)).tuples())
        assert ecc(store) == ecc(whole)
    finally:
        whole.dispose()


def test_a_gpu_an_agent_also_reports_is_never_written_twice(prom, store):
    """gpu-a runs an agent too: its GPU 0 is the agent's device (nvml), which the import writes into. Each run resumes
    after that device's last sample, the agent's or an import's, as it does for the devices imports created."""
    agent_at = T0 + 40 * STEP + 7  # the agent's last reading, between two scrapes
    with store.session() as s:
        register_host(s, "gpu-a", hostname="gpu-a", source="nvml")
        (dev,) = register_devices(s, "gpu-a", [DeviceSpec(0, "GPU-aaaa", "NVIDIA H100 80GB HBM3", 80 << 30)],
                                  source="nvml").values()
        s.add(DeviceSample(device_id=dev, ts=agent_at, gpu_util=0.5))
    first = _import(store, prom.url)
    assert _import(store, prom.url).device_samples == 0  # the same range again: nothing new
    with store.session() as s:
        times = [t for (t,) in s.execute(select(DeviceSample.ts).where(DeviceSample.device_id == dev)
                                         .order_by(DeviceSample.ts))]
        twice = s.execute(select(DeviceSample.device_id, DeviceSample.ts).group_by(DeviceSample.device_id,
                          DeviceSample.ts).having(func.count() > 1)).all()
    assert times == [agent_at] + [T0 + i * STEP for i in range(41, N)] and not twice
    assert first.device_samples == 2 * N + (N - 41)  # gpu-b and the MIG slice whole, gpu-a:0 after the agent

def test_one_import_at_a_time_writes_into_a_database(prom, any_store):
    """serve's periodic import and a `fleetlens import-prometheus` (or the DAG on another host) at once both found the
    same points missing and both wrote them: one run at a time, the other told so (and serve's skipped quietly)."""
    store = any_store
    _import(store, prom.url, until=T0 + 10 * STEP)
    with single_run(store, "prometheus-import") as held:  # a run in another process or host holds it
        assert held
        with pytest.raises(ImportRunning, match="another import from Prometheus is writing into this database"):
            _import(store, prom.url, since=None)
        assert import_from_settings(store, _settings(prometheus_url=prom.url))["skipped"].startswith("another")
        with single_run(store, "prometheus-import") as again:
            assert not again
    assert _counts(store)[3] == 3 * 11  # the first run's alone: three GPUs, minutes 0 to 10
    _import(store, prom.url, since=None)  # released: the next run resumes
    with store.session() as s:
        twice = s.execute(select(DeviceSample.device_id, DeviceSample.ts).group_by(
            DeviceSample.device_id, DeviceSample.ts).having(func.count() > 1)).all()
    assert _counts(store)[3] == 2 * N + (N - len(GAP)) and not twice

def test_prometheus_down_writes_nothing_and_the_next_run_picks_up(prom, store):
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(UpstreamUnavailable, match="cannot be reached.*check the URL"):
        _import(store, dead)
    assert _counts(store) == (0, 0, 0, 0, 0)
    assert _import(store, prom.url).device_samples == 2 * N + (N - len(GAP))


def test_a_wrong_url_says_so_and_writes_nothing(prom, store):
    with pytest.raises(InvalidInput, match="without Prometheus's JSON.*base URL"):
        _import(store, f"{prom.url}/graph/")
    with pytest.raises(InvalidInput, match="not a Prometheus URL"):
        _import(store, "prometheus:9090")
    with pytest.raises(InvalidInput, match="after --until"):
        _import(store, prom.url, since=END, until=T0)
    assert _counts(store) == (0, 0, 0, 0, 0)


@contextmanager
def _gateway(upstream: str, own: Callable[[str, dict[str, list[str]]], int | None]) -> Iterator[str]:
    """A reverse proxy in front of `upstream` (as nginx would be) that answers a request with an HTML page of its own
    and the status `own(path, query)` gives, or passes it on (None)."""

    class Gateway(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            parts = urlsplit(self.path)
            status = own(parts.path, parse_qs(parts.query))
            if status is not None:
                body, kind = f"<html><body><h1>{status}</h1>nginx</body></html>".encode(), "text/html"
            else:
                answer = httpx.get(upstream + self.path, timeout=30)
                status, body, kind = answer.status_code, answer.content, answer.headers["content-type"]
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Gateway)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_a_gateway_error_says_prometheus_is_away_keeps_what_was_written_and_the_next_run_completes(prom, store):
    whole = 2 * N + (N - len(GAP))
    settings = _settings(prometheus_window_s=1500)  # three windows; the second one meets the 502
    # Prometheus goes away in the middle of the import: the proxy answers 502 Bad Gateway from the second window on
    with _gateway(prom.url, lambda path, query: 502 if path == "/api/v1/query_range" and
                  float(query["start"][0]) >= T0 + 1500 else None) as url:
        with pytest.raises(UpstreamUnavailable, match=r"HTTP 502 \(Bad Gateway\).*down or overloaded; try again "
                                                      r"later\. Before that, \d+ device samples up to \d+"):
            _import(store, url, settings=settings)
    first = _counts(store)[3]
    assert 0 < first < whole  # the first window is kept
    assert _import(store, prom.url, since=None, settings=settings).device_samples == whole - first
    assert _counts(store)[3] == whole

def test_a_server_without_label_values_is_not_said_to_have_old_names(prom, store, caplog):
    """A proxy that does not pass label values on gets every name queried; that is no sign of dcgm-exporter 1.x."""
    with _gateway(prom.url, lambda path, _: 404 if path.startswith("/api/v1/label/") else None) as url:
        assert _import(store, url).device_samples == 2 * N + (N - len(GAP))
    assert "1.x" not in caplog.text

def test_a_time_in_milliseconds_is_refused_and_not_fetched_as_thousands_of_years(store):
    """Epoch milliseconds (Grafana's from=/to=) taken as seconds: --since after --until, or a range of millions of
    windows up to the year 55,000 planned (gigabytes of windows before any query)."""
    nowhere = f"http://127.0.0.1:{free_port()}"  # refused before Prometheus is asked
    with pytest.raises(InvalidInput, match=r"--since 1699999980000 is in milliseconds.*give 1699999980"):
        _import(store, nowhere, since=T0 * 1000)
    with pytest.raises(InvalidInput, match=r"--until 1700003520000 is in milliseconds.*give 1700003520"):
        _import(store, nowhere, until=END * 1000)
    assert _counts(store) == (0, 0, 0, 0, 0)

def test_cli_imports_and_reports_errors_in_one_line(prom, fleet_home, capsys):
    assert cli(["init"]) == 0
    args = ["import-prometheus", prom.url, "--since", repr(T0), "--until", repr(END), "--step", "1m"]
    assert cli(args) == 0
    out = capsys.readouterr().out
    assert "imported 170 device and 110 process samples" in out and "1 series without a gpu or UUID label" in out
    assert cli(args) == 0
    assert "imported 0 device and 0 process samples" in capsys.readouterr().out
    assert cli(["import-prometheus", f"http://127.0.0.1:{free_port()}", "--since", "1h"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fleetlens: Prometheus at http://127.0.0.1:") and "Traceback" not in err
    assert cli(["import-prometheus", prom.url, "--step", "fast"]) == 2
    assert "not a positive duration" in capsys.readouterr().err


@pytest.mark.pg
def test_database_down_says_so_and_the_next_run_picks_up(prom, pg_url):
    proxy = TcpProxy(make_url(pg_url).host or "127.0.0.1", make_url(pg_url).port or 5432).start()
    store = Store(proxy.url(pg_url), connect_timeout_s=2)
    try:
        upgrade(store)
        proxy.cut()
        with pytest.raises(DatabaseUnavailable):
            _import(store, prom.url)
        proxy.restore()
        assert _counts(store) == (0, 0, 0, 0, 0)
        assert _import(store, prom.url).device_samples == 2 * N + (N - len(GAP))
    finally:
        proxy.cut()
        store.dispose()


def _drop_sessions_writing(store: Store, condition: str, pause_s: float = 0.0) -> None:
    """The server ends the session of any insert into device_samples whose row meets `condition` (after `pause_s`),
    as a crash or a failover would."""
    with store.engine.begin() as conn:
        conn.execute(text(f"""
            CREATE FUNCTION drop_session() RETURNS trigger AS $$
            BEGIN IF {condition} THEN
                PERFORM pg_sleep({pause_s!r}); PERFORM pg_terminate_backend(pg_backend_pid()); END IF; RETURN NEW; END
            $$ LANGUAGE plpgsql"""))
        conn.execute(text("CREATE TRIGGER drop_session BEFORE INSERT ON device_samples "
                          "FOR EACH ROW EXECUTE FUNCTION drop_session()"))


def _import_fails_keeping_nothing_after(store: Store, prom, edge: float, settings: Settings) -> None:
    """The import fails saying where the next run resumes; nothing after `edge` stays (samples, or the failed
    window's registration), what came before does; once the server is well, the next run fills the rest."""
    with pytest.raises(DatabaseUnavailable, match=r"Before that, \d+ device samples up to .* the next run resumes"):
        _import(store, prom.url, settings=settings)
    with store.session() as s:
        assert s.scalar(select(func.max(DeviceSample.ts))) <= edge
        assert s.scalar(select(func.max(ProcessSample.ts))) <= edge
        assert s.scalar(select(func.max(Workflow.last_seen))) <= edge
        assert s.scalar(select(func.max(Process.last_seen))) <= edge
        assert s.scalar(select(func.count()).select_from(DeviceSample)) > 0
    with store.engine.begin() as conn:
        conn.execute(text("DROP TRIGGER drop_session ON device_samples"))
    _import(store, prom.url, since=None, settings=settings)
    assert _import(store, prom.url, settings=settings).device_samples == 0
    with store.session() as s:
        assert s.scalar(select(func.count()).select_from(DeviceSample)) == 2 * N + (N - len(GAP))


@pytest.mark.pg
def test_database_lost_between_registration_and_samples_leaves_nothing_of_the_window(prom, pg_store):
    """The database drops the connection while a window's samples are being copied, after its hosts, devices,
    workflows and processes were written in the same transaction: none of that window stays, the windows before
    it do, and the next run fills the rest."""
    edge = T0 + 1500  # the first window's end (windows of 25 minutes)
    _drop_sessions_writing(pg_store, f"NEW.ts > {edge!r}")
    _import_fails_keeping_nothing_after(pg_store, prom, edge, _settings(prometheus_window_s=1500))


@pytest.mark.pg
def test_a_window_after_a_failed_one_is_not_kept_though_it_was_written_alongside(prom, pg_store):
    """On PostgreSQL the window after the one being written copies its samples at the same time, on a connection of
    its own; when the earlier window fails after that copy is done, the later one is rolled back too, so the store
    never holds a window without every window before it, and the next run resumes at the failed window."""
    edge, next_edge = T0 + 1500, T0 + 3000  # windows of 25 minutes: the second fails, the third alone would not
    # the second window's first row waits long enough for the third to be copied
    _drop_sessions_writing(pg_store, f"NEW.ts > {edge!r} AND NEW.ts <= {next_edge!r}", pause_s=2.0)
    _import_fails_keeping_nothing_after(pg_store, prom, edge, _settings(prometheus_window_s=1500))


@pytest.mark.pg
def test_windows_written_together_mark_their_late_hours_in_window_order(prom, pg_store, monkeypatch):
    """Two windows are written at once on PostgreSQL, and the later one waits for the earlier's commit holding its
    transaction open. Had it marked an hour they share first, it would hold that hour's row while the earlier one,
    waiting for the row, never commits: the import hung. Here the first window's mark waits until the second has
    marked (up to 5 s, under a 5 s lock timeout), as the writers' threads may order it; the import must go through."""
    real = late_hours.mark
    shared = threading.Event()  # the second window (T0+1500..T0+3000, two hours) has marked the hour it shares

    def mark(conn, is_postgres, hours):
        hours = set(hours)
        if len(hours) == 1 and not shared.is_set():  # the first window (T0..T0+1500, the hour before T0+2820)
            shared.wait(5)
            conn.exec_driver_sql("SET LOCAL lock_timeout = '5s'")
        real(conn, is_postgres, hours)
        if len(hours) == 2:
            shared.set()

    monkeypatch.setattr(late_hours, "mark", mark)
    done = _import(pg_store, prom.url, settings=_settings(prometheus_window_s=1500))
    assert done.device_samples == 2 * N + (N - len(GAP))
    hour = 3600.0
    first = T0 - T0 % hour
    assert late_hours.marks(pg_store, END + hour) == {first: 1 + 1, first + hour: 1 + 1}  # each window's, once


def test_the_cyclic_collector_is_off_while_importing_and_back_after(prom, store, monkeypatch):
    """Decoding a window allocates hundreds of thousands of lists: the cyclic collector is paused meanwhile (it took
    longer than the decoding), and is on again afterwards, after a failed import too; one paused by the caller
    stays off."""
    from collector.importers.prometheus_http import PrometheusClient

    during = []
    fetch = PrometheusClient.fetch

    def watched(self, *args, **kwargs):
        during.append(gc.isenabled())
        return fetch(self, *args, **kwargs)

    monkeypatch.setattr(PrometheusClient, "fetch", watched)
    assert gc.isenabled()
    _import(store, prom.url)
    assert during and not any(during)
    assert gc.isenabled()
    with pytest.raises(UpstreamUnavailable):
        _import(store, f"http://127.0.0.1:{free_port()}")
    assert gc.isenabled()
    gc.disable()
    try:
        _import(store, prom.url)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_only_metrics_with_series_in_the_range_are_queried(prom, store, monkeypatch):
    """One label-values call says which of dcgm-exporter's fields the fleet exports; each window asks for those
    alone, and a server that refuses that call is asked for every field."""
    from collector.dcgm_names import FIELDS
    from collector.importers.prometheus_http import PrometheusClient

    exported = {"DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_POWER_USAGE",
                "DCGM_FI_PROF_GR_ENGINE_ACTIVE", "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "DCGM_FI_DEV_XID_ERRORS"}
    asked: list[str] = []
    query_range = PrometheusClient.query_range

    def recorded(self, query, *args):
        asked.append(query.split("(", 1)[1].split("[", 1)[0])
        return query_range(self, query, *args)

    monkeypatch.setattr(PrometheusClient, "query_range", recorded)
    with PrometheusClient(prom.url) as client:
        assert client.names_present([f.name for f in FIELDS], T0, END) == [f.name for f in FIELDS
                                                                           if f.name in exported]
        assert client.names_present(["DCGM_FI_DEV_GPU_UTIL"], END + 86400, END + 2 * 86400) == []
    summary = _import(store, prom.url, settings=_settings(prometheus_window_s=1500))
    assert set(asked) == exported and len(asked) == 3 * len(exported)  # three windows of 25 minutes
    assert summary.device_samples == 2 * N + (N - len(GAP))

    # a server that refuses label values with match[]: every field is asked for, and the import is the same
    def refused(self, path, params, *, refusal=None):
        if path.startswith("/api/v1/label/"):
            return refusal
        return get(self, path, params)

    get = PrometheusClient._get
    monkeypatch.setattr(PrometheusClient, "_get", refused)
    asked.clear()
    with PrometheusClient(prom.url) as client:
        assert client.names_present([f.name for f in FIELDS], T0, END) == [f.name for f in FIELDS]
    again = _import(store, prom.url)
    # every field, and the agent's series of which workflow uses which device
    assert set(asked) == {f.name for f in FIELDS} | {"fleetlens_device_workflow"} and again.device_samples == 0


def test_answers_come_uncompressed_unless_asked(prom, store, monkeypatch, tmp_path):
    """Prometheus gzips an answer only when asked (FLEETLENS_PROMETHEUS_COMPRESS): compressing took it most of its
    CPU for an import, which a fast link does not repay; a compressed import writes the same."""
    from collector.importers.prometheus_http import PrometheusClient

    encodings: list[str | None] = []
    init = PrometheusClient.__init__

    def watched(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._http.event_hooks["response"].append(lambda r: encodings.append(r.headers.get("content-encoding")))

    monkeypatch.setattr(PrometheusClient, "__init__", watched)
    plain = _import(store, prom.url)
    assert encodings and set(encodings) == {None}
    encodings.clear()
    other = Store(f"sqlite:///{tmp_path / 'gzip.db'}")
    upgrade(other)
    try:
        packed = _import(other, prom.url, settings=_settings(prometheus_compress=True))
        assert "gzip" in encodings
        assert (packed.device_samples, packed.process_samples) == (plain.device_samples, plain.process_samples)
        assert _counts(other) == _counts(store)
    finally:
        other.dispose()
