"""`fleetlens import-prometheus` against dcgm-exporter as fleets run it, in a real Prometheus.

The expositions follow dcgm-exporter's documentation, issues and pull requests: today's `hostname` label
(NVIDIA/dcgm-exporter#655) and the `Hostname` before it; MIG instances (GPU_I_ID, GPU_I_PROFILE) of two profiles with
one pod on two slices; dcgm-exporter 1.x's names (dcgm_gpu_utilization, uuid, pod_name, pod_namespace); a
kube-prometheus scrape, where Prometheus itself (honor_labels: false, the ServiceMonitor default) renames the pod labels
dcgm-exporter wrote to exported_*; and a Prometheus with no DCGM series at all.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from sqlalchemy import select

from collector.importers.dcgm_labels import MIG_INDEX_BASE
from collector.importers.prometheus import NoDcgmSeries, import_prometheus
from store.db import Store
from store.models import Device, DeviceSample, Finding, Host, ProcessSample, Workflow
from store.settings import Settings, get_settings
from tests.prometheus_server import PrometheusServer, free_port, prometheus, recorded_prometheus
from ui.cli import run as cli

T0 = 1_700_003_580.0  # on the step grid
STEP = 60.0
N = 30
END = T0 + (N - 1) * STEP
MIB = 1 << 20

H100 = 'modelName="NVIDIA H100 80GB HBM3",DCGM_FI_DRIVER_VERSION="550.144.03"'
A100 = 'modelName="NVIDIA A100-SXM4-80GB",DCGM_FI_DRIVER_VERSION="550.144.03"'
# today's dcgm-exporter: lower-case hostname, the Kubernetes mapping on
NEW = f'gpu="0",UUID="GPU-new0",pci_bus_id="00000000:8D:00.0",device="nvidia0",{H100},hostname="node-new",' \
      'container="trainer",namespace="vision",pod="resnet-0"'
# before the rename: Hostname
OLD = f'gpu="0",UUID="GPU-old0",pci_bus_id="00000000:91:00.0",device="nvidia0",{H100},Hostname="node-old",' \
      'container="trainer",namespace="nlp",pod="bert-0"'
# MIG on an A100: a 3g.40gb instance idle, two 1g.10gb instances used by one pod
MIG = f'gpu="0",UUID="GPU-mig0",device="nvidia0",{A100},hostname="node-mig"'
MIG3 = f'{MIG},GPU_I_ID="1",GPU_I_PROFILE="3g.40gb"'
MIG1A = f'{MIG},GPU_I_ID="2",GPU_I_PROFILE="1g.10gb",container="server",namespace="serving",pod="infer-0"'
MIG1B = f'{MIG},GPU_I_ID="3",GPU_I_PROFILE="1g.10gb",container="server",namespace="serving",pod="infer-0"'
# dcgm-exporter 1.x (gpu-monitoring-tools): lower-case names, uuid, pod_name, pod_namespace, container_name
LEGACY = 'gpu="0",uuid="GPU-leg0",pod_name="old-job",pod_namespace="research",container_name="main",' \
         'instance="10.0.0.14:9400",job="dcgm"'


def _openmetrics() -> str:
    lines: list[str] = []

    def family(name: str, kind: str, rows: list[tuple[str, float]]) -> None:
        lines.append(f"# TYPE {name} {kind}")
        for i in range(N):
            for labels, value in rows:
                lines.append(f"{name}{{{labels}}} {value!r} {T0 + i * STEP!r}")

    family("DCGM_FI_DEV_GPU_UTIL", "gauge", [(NEW, 80.0), (OLD, 40.0)])
    family("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "gauge", [(MIG3, 0.0), (MIG1A, 0.5), (MIG1B, 0.5)])
    family("DCGM_FI_DEV_FB_USED", "gauge", [(NEW, 60000.0), (OLD, 30000.0), (MIG3, 0.0), (MIG1A, 9000.0),
                                            (MIG1B, 9000.0)])
    family("DCGM_FI_DEV_FB_FREE", "gauge", [(NEW, 21559.0), (OLD, 51559.0), (MIG3, 40192.0), (MIG1A, 728.0),
                                            (MIG1B, 728.0)])
    family("dcgm_gpu_utilization", "gauge", [(LEGACY, 20.0)])
    family("dcgm_fb_used", "gauge", [(LEGACY, 1024.0)])
    family("dcgm_fb_free", "gauge", [(LEGACY, 15136.0)])
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
    kw.setdefault("step", STEP)
    return import_prometheus(store, url, settings=_settings(), now=kw["until"] + 60, **kw)


def test_todays_and_older_host_labels_name_the_host(prom, store):
    _import(store, prom.url)
    with store.session() as s:
        hosts = set(s.scalars(select(Host.id)))
        by_uuid = {d.uuid: d.host_id for d in s.scalars(select(Device))}
    assert {"node-new", "node-old", "node-mig"} <= hosts
    assert (by_uuid["GPU-new0"], by_uuid["GPU-old0"]) == ("node-new", "node-old")
    assert not [h for h in hosts if ":" in h and h != "10.0.0.14"]  # no scrape address stands for a host


def test_mig_slices_are_devices_and_a_job_on_two_slices_holds_two(prom, store):
    _import(store, prom.url)
    with store.session() as s:
        devices = {d.index: d for d in s.scalars(select(Device).where(Device.host_id == "node-mig"))}
        wf = s.get(Workflow, "k8s-serving/infer-0")
        used = {d for (d,) in s.execute(select(ProcessSample.device_id)
                                        .where(ProcessSample.workflow_id == "k8s-serving/infer-0").distinct())}
    assert set(devices) == {MIG_INDEX_BASE + 1, MIG_INDEX_BASE + 2, MIG_INDEX_BASE + 3}
    assert devices[MIG_INDEX_BASE + 1].name == "NVIDIA A100-SXM4-80GB MIG 3g.40gb"
    assert devices[MIG_INDEX_BASE + 2].name == "NVIDIA A100-SXM4-80GB MIG 1g.10gb"
    assert devices[MIG_INDEX_BASE + 2].memory_total == (9000 + 728) * MIB
    assert wf is not None and wf.gpus == 2
    assert used == {devices[MIG_INDEX_BASE + 2].id, devices[MIG_INDEX_BASE + 3].id}


def test_dcgm_exporter_1x_names_and_labels_are_read(prom, store):
    _import(store, prom.url)
    with store.session() as s:
        dev = s.scalars(select(Device).where(Device.uuid == "GPU-leg0")).one()
        util, used = s.execute(select(DeviceSample.gpu_util, DeviceSample.mem_used)
                               .where(DeviceSample.device_id == dev.id).limit(1)).one()
        wf = s.get(Workflow, "k8s-research/old-job")
    assert dev.host_id == "10.0.0.14"  # 1.x wrote no host label: the scrape address's host
    assert (util, used, dev.memory_total) == (pytest.approx(0.2), 1024 * MIB, 16160 * MIB)
    assert wf is not None and wf.labels["container"] == "main"


@pytest.fixture(scope="module")
def unrelated(tmp_path_factory) -> Iterator[PrometheusServer]:
    """A Prometheus with node metrics and a DCGM-like name fleetlens does not read, but no dcgm-exporter series."""
    folder = tmp_path_factory.mktemp("unrelated")
    lines = ["# TYPE node_load1 gauge", "# TYPE DCGM_CUSTOM_GPU_BUSY gauge"]
    for i in range(N):
        lines.append(f'node_load1{{instance="node-new:9100"}} 1.5 {T0 + i * STEP!r}')
    lines.append("# EOF")
    late = ["# TYPE DCGM_CUSTOM_GPU_BUSY gauge"] + [
        f'DCGM_CUSTOM_GPU_BUSY{{gpu="0",hostname="node-new"}} 0.5 {T0 + 86400 + i * STEP!r}' for i in range(N)]
    with recorded_prometheus(folder, "\n".join(lines) + "\n", "\n".join([*late, "# EOF"]) + "\n") as server:
        yield server


def test_a_prometheus_without_dcgm_series_is_told_and_exits_non_zero(unrelated, store, fleet_home, capsys):
    with pytest.raises(NoDcgmSeries, match="no dcgm-exporter series.*nor any metric named like DCGM"):
        _import(store, unrelated.url)
    # a day later it has a DCGM-like metric of a name fleetlens does not read: the message names it
    with pytest.raises(NoDcgmSeries, match="DCGM-like metrics are DCGM_CUSTOM_GPU_BUSY"):
        _import(store, unrelated.url, since=T0 + 86400, until=END + 86400)
    assert cli(["init"]) == 0
    assert cli(["import-prometheus", unrelated.url, "--since", repr(T0), "--until", repr(END)]) == 2
    err = capsys.readouterr().err
    assert "no dcgm-exporter series" in err and "Traceback" not in err


# ---- a kube-prometheus scrape: Prometheus renames the pod labels itself -------------------------------------------

EXPORTER_POD = {"pod": "nvidia-dcgm-exporter-x7k2p", "namespace": "gpu-operator", "container": "nvidia-dcgm-exporter"}
# as dcgm-exporter serves it on :9400/metrics (no timestamps): GPU 0 used by a pod, GPU 1 idle (no pod labels)
SCRAPED = (
    "# HELP DCGM_FI_DEV_GPU_UTIL GPU utilization (in %).\n# TYPE DCGM_FI_DEV_GPU_UTIL gauge\n"
    f'DCGM_FI_DEV_GPU_UTIL{{gpu="0",UUID="GPU-k8s0",device="nvidia0",{H100},hostname="gpu-node-3",'
    'container="trainer",namespace="vision",pod="detr-0"} 70\n'
    f'DCGM_FI_DEV_GPU_UTIL{{gpu="1",UUID="GPU-k8s1",device="nvidia1",{H100},hostname="gpu-node-3"}} 0\n'
    "# HELP DCGM_FI_DEV_FB_USED Framebuffer memory used (in MiB).\n# TYPE DCGM_FI_DEV_FB_USED gauge\n"
    f'DCGM_FI_DEV_FB_USED{{gpu="0",UUID="GPU-k8s0",device="nvidia0",{H100},hostname="gpu-node-3",'
    'container="trainer",namespace="vision",pod="detr-0"} 50000\n'
    f'DCGM_FI_DEV_FB_USED{{gpu="1",UUID="GPU-k8s1",device="nvidia1",{H100},hostname="gpu-node-3"}} 0\n'
)


class _Exporter(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        body = SCRAPED.encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        pass


def _kube_prometheus_config(target: str) -> str:
    """What kube-prometheus-stack makes of a ServiceMonitor without honorLabels: honor_labels false, and the target
    labelled with the exporter pod's own namespace, pod, container, service and endpoint (by Kubernetes service
    discovery there; written out here, as static labels)."""
    labels = {**EXPORTER_POD, "service": "nvidia-dcgm-exporter", "endpoint": "gpu-metrics"}
    label_lines = "".join(f"          {k}: {v}\n" for k, v in labels.items())
    return ("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:\n"
            "  - job_name: serviceMonitor/gpu-operator/nvidia-dcgm-exporter/0\n    honor_labels: false\n"
            f"    static_configs:\n      - targets: ['{target}']\n        labels:\n{label_lines}")


def test_kube_prometheus_relabelling_keeps_the_workloads_not_the_exporter(tmp_path, store):
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), _Exporter)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        target = f"127.0.0.1:{server.server_address[1]}"
        with prometheus(tmp_path / "prom", config_text=_kube_prometheus_config(target)) as prom:
            deadline = time.monotonic() + 60
            while True:
                got = prom.query("count_over_time(DCGM_FI_DEV_FB_USED[1m])")
                if len(got) == 2 and min(float(r["value"][1]) for r in got) >= 4:
                    break
                assert time.monotonic() < deadline, got
                time.sleep(0.5)
            # Prometheus renamed what dcgm-exporter wrote, and put the target's own labels in their place
            used = {r["metric"]["gpu"]: r["metric"] for r in prom.query("DCGM_FI_DEV_GPU_UTIL")}
            assert (used["0"]["exported_pod"], used["0"]["pod"]) == ("detr-0", EXPORTER_POD["pod"])
            assert "exported_pod" not in used["1"] and used["1"]["pod"] == EXPORTER_POD["pod"]
            now = time.time()
            summary = import_prometheus(store, prom.url, since=now - 60, until=now, step=1.0, settings=_settings(),
                                        now=now + 1)
    finally:
        server.shutdown()
        server.server_close()
    assert summary.devices == 2
    with store.session() as s:
        wfs = {w.id: w for w in s.scalars(select(Workflow))}
        users = {(d, w) for d, w in s.execute(select(Device.index, ProcessSample.workflow_id)
                                              .join(Device, Device.id == ProcessSample.device_id).distinct())}
        hosts = set(s.scalars(select(Host.id)))
    assert set(wfs) == {"k8s-vision/detr-0"}  # neither GPU is the exporter's
    assert (wfs["k8s-vision/detr-0"].team, wfs["k8s-vision/detr-0"].labels["container"]) == ("vision", "trainer")
    assert users == {(0, "k8s-vision/detr-0")}  # the idle GPU has no user
    assert hosts == {"gpu-node-3"}


def test_only_the_labels_prometheus_renamed_on_a_target_are_the_targets():
    """A target that renamed namespace only (its pod and container labels dropped by the ServiceMonitor's
    relabelings, as deploy/kubernetes does for fleetlens's agent) keeps the pod its series wrote."""
    from collector.importers.dcgm_labels import as_written, renamed_labels

    user = {"gpu": "0", "workflow": "wf", "pod": "train-0", "exported_namespace": "vision", "namespace": "fleetlens"}
    device = {"gpu": "0", "namespace": "fleetlens"}
    target = renamed_labels(user)
    assert target == {"namespace"}
    assert as_written(user, target) == {"gpu": "0", "workflow": "wf", "pod": "train-0", "namespace": "vision",
                                        "exported_namespace": "vision"}
    assert as_written(device, target) == {"gpu": "0"}
    # the exporter's own pod, with nothing renamed (honorLabels: true): no workload
    assert "pod" not in as_written({"gpu": "1", "pod": "nvidia-dcgm-exporter-x7k2p", "namespace": "gpu-operator"})


# ---- one basis for GPU-hours, MIG slices at their share: the README's commands, before and after a rollup ---------

H0 = 1_700_002_800.0  # on the hour
HOURS = 2
IDLE = f'gpu="0",UUID="GPU-idle",device="nvidia0",{H100},hostname="node-a",namespace="ml",pod="idle-0"'
BUSY = f'gpu="1",UUID="GPU-busy",device="nvidia1",{H100},hostname="node-a",namespace="ml",pod="busy-0"'
SLICE = f'gpu="0",UUID="GPU-slices",device="nvidia0",{A100},hostname="node-m"'
SLICE_A = f'{SLICE},GPU_I_ID="2",GPU_I_PROFILE="1g.10gb",namespace="ml",pod="mig-idle"'
SLICE_B = f'{SLICE},GPU_I_ID="3",GPU_I_PROFILE="1g.10gb",namespace="ml",pod="mig-idle"'
SLICE_C = f'{SLICE},GPU_I_ID="1",GPU_I_PROFILE="3g.40gb",namespace="ml",pod="mig-busy"'
NOMEM = f'gpu="0",UUID="GPU-nomem",device="nvidia0",{H100},hostname="node-b",namespace="ml",pod="nomem-0"'


@pytest.fixture(scope="module")
def two_hours(tmp_path_factory) -> Iterator[PrometheusServer]:
    """Two hours of a fleet: a whole GPU held idle, one busy, two 1g.10gb slices held idle by one pod, a busy
    3g.40gb slice, and an idle GPU whose memory series are not exported; every 60 s."""
    folder = tmp_path_factory.mktemp("two_hours")
    lines: list[str] = []
    n = HOURS * 60

    def family(name: str, rows: list[tuple[str, float]]) -> None:
        lines.append(f"# TYPE {name} gauge")
        for i in range(n):
            lines.extend(f"{name}{{{labels}}} {value!r} {H0 + i * 60.0!r}" for labels, value in rows)

    family("DCGM_FI_DEV_GPU_UTIL", [(IDLE, 0.0), (BUSY, 95.0), (NOMEM, 0.0)])
    family("DCGM_FI_PROF_GR_ENGINE_ACTIVE", [(SLICE_A, 0.0), (SLICE_B, 0.0), (SLICE_C, 0.9)])
    family("DCGM_FI_DEV_FB_USED", [(IDLE, 40000.0), (BUSY, 70000.0), (SLICE_A, 8000.0), (SLICE_B, 8000.0),
                                   (SLICE_C, 30000.0)])
    family("DCGM_FI_DEV_FB_FREE", [(IDLE, 41559.0), (BUSY, 11559.0), (SLICE_A, 1728.0), (SLICE_B, 1728.0),
                                   (SLICE_C, 10192.0)])
    lines.append("# EOF")
    with recorded_prometheus(folder, "\n".join(lines) + "\n") as server:
        yield server


def _rank(capsys, now: float) -> dict:
    import json

    capsys.readouterr()
    assert cli(["rank", "--json", "--now", repr(now), "--limit", "50"]) == 0
    return json.loads(capsys.readouterr().out)


def test_rank_says_the_same_before_and_after_a_rollup_with_slices_at_their_share(two_hours, fleet_home, capsys):
    end = H0 + HOURS * 3600
    assert cli(["init"]) == 0
    assert cli(["import-prometheus", two_hours.url, "--since", repr(H0), "--until", repr(end - 60),
                "--step", "60s"]) == 0
    assert cli(["detect", "--now", repr(end), "--window-hours", str(HOURS)]) == 0
    before = _rank(capsys, end)  # a day of 24 closed hours, the last two of them imported
    assert cli(["rollup", "--now", repr(end), "--keep-raw"]) == 0
    after = _rank(capsys, end)
    # one figure, one basis, named
    assert before["per_day"] == after["per_day"] and "averaged over the closed hours" in after["per_day"]
    for key in ("recoverable_gpu_hours_per_day", "held_gpu_hours_per_day"):
        assert before[key] == pytest.approx(after[key], abs=1e-3), key
    rows = {when: {r["workflow_id"]: r for r in ranked["workflows"]} for when, ranked in (("b", before), ("a", after))}
    assert set(rows["b"]) == set(rows["a"]) == {"k8s-ml/idle-0", "k8s-ml/busy-0", "k8s-ml/mig-idle",
                                                "k8s-ml/mig-busy", "k8s-ml/nomem-0"}
    for wf, row in rows["a"].items():
        first = rows["b"][wf]
        for key in ("recoverable_gpu_hours_per_day", "held_gpu_hours_per_day", "gpu_hours_held", "util_mean"):
            assert first[key] == pytest.approx(row[key], abs=1e-3), (wf, key)
        assert row["util_mean"] is not None
    # held per day, averaged over a day whose two first hours were observed: a whole GPU 2 h, two 1g.10gb slices of
    # an A100 (1/7 each) 2 x 2 h / 7, a 3g.40gb slice 2 h x 3/7
    held = {wf: r["held_gpu_hours_per_day"] for wf, r in rows["a"].items()}
    assert held == pytest.approx({wf: r["gpu_hours_held"] for wf, r in rows["a"].items()})
    assert held == pytest.approx({"k8s-ml/idle-0": 2.0, "k8s-ml/busy-0": 2.0, "k8s-ml/mig-idle": 4 / 7,
                                  "k8s-ml/mig-busy": 6 / 7, "k8s-ml/nomem-0": 2.0}, rel=0.02)
    recoverable = {wf: r["recoverable_gpu_hours_per_day"] for wf, r in rows["a"].items()}
    # what the idle holders give back is bounded by what they held: the two slices never count as two whole GPUs
    assert 0 < recoverable["k8s-ml/mig-idle"] <= 4 / 7 + 1e-6
    assert recoverable["k8s-ml/idle-0"] > 3 * recoverable["k8s-ml/mig-idle"]
    assert after["held_gpu_hours_per_day"] == pytest.approx(2.0 + 2.0 + 4 / 7 + 6 / 7 + 2.0, rel=0.02)
    # a GPU without memory series: judged on its utilisation, and its findings say what is not known
    st = Store(get_settings().resolved_db_url)
    try:
        with st.session() as s:
            titles = list(s.scalars(select(Finding.title).where(Finding.workflow_id == "k8s-ml/nomem-0")))
    finally:
        st.dispose()
    assert titles and all("?" not in t for t in titles)
    assert any(t.startswith("holds node-b") and "memory it holds is not known" in t for t in titles), titles
