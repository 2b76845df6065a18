"""The cpu source on this machine's real cores and real processes, and `open_source` picking a source."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import psutil
import pytest

from collector.launch import spawn_job
from collector.sources import open_source
from collector.sources.base import SourceUnavailable
from collector.sources.cpu import CpuSource
from collector.sources.replay import ReplaySource
from collector.sources.run_queue import delay_growth, thread_delays
from store.errors import ConfigError, InvalidInput
from store.settings import Settings
from tests.gpu.probe import nvml_init_error

BUSY = [sys.executable, "-c", "import os\nos.sched_setaffinity(0, {0})\nwhile True: pass"]
# An idle child says "ready" once its interpreter has started, so start-up CPU is not taken for work.
IDLE = [sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(60)"]


@pytest.fixture
def spawn() -> Iterator:
    children: list[subprocess.Popen] = []

    def start(argv: list[str], env_extra: dict[str, str] | None = None) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETLENS_")}
        env.update(env_extra or {})
        child = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True)
        children.append(child)
        deadline = time.monotonic() + 10
        while psutil.Process(child.pid).cmdline() != argv:  # wait for the exec, so environ is the child's
            assert time.monotonic() < deadline
            time.sleep(0.01)
        if argv is IDLE:
            assert child.stdout.readline() == "ready\n"
        return child

    yield start
    for child in children:
        child.kill()
        child.wait()


def _find(readings, pid: int):
    for r in readings:
        for p in r.processes:
            if p.pid == pid:
                return r, p
    return None, None


def test_one_device_per_core_by_default_with_a_share_of_ram() -> None:
    src = CpuSource(host_id="h1")
    n = psutil.cpu_count()
    infos = src.devices()
    assert [d.cpu_cores for d in infos] == [(c,) for c in range(n)]
    assert infos[0].uuid == "cpu:h1:0-0" and infos[0].name == "cpu core 0"
    assert sum(d.memory_total for d in infos) == pytest.approx(psutil.virtual_memory().total, abs=n)
    readings = src.sample()
    assert [r.index for r in readings] == list(range(n))
    assert all(0.0 <= r.gpu_util <= 1.0 and 0 <= r.mem_used for r in readings)


def test_cores_group_into_devices() -> None:
    n = psutil.cpu_count()
    src = CpuSource(cores_per_device=n, host_id="h2")
    (only,) = src.devices()
    assert only.cpu_cores == tuple(range(n)) and only.memory_total == psutil.virtual_memory().total
    assert len(src.sample()) == 1
    with pytest.raises(ConfigError, match="at least 1"):
        CpuSource(cores_per_device=0)


def test_a_marked_busy_process_is_reported_on_its_core(spawn) -> None:
    child = spawn(BUSY, {"FLEETLENS_WORKFLOW": "busy-job"})
    src = CpuSource(host_id="h3")
    first_device, first = _find(src.sample(), child.pid)
    assert first is not None and first.mem_used > 0  # marked: reported from its first sample
    time.sleep(0.5)
    device, proc = _find(src.sample(), child.pid)
    assert device is not None and device.index == 0  # pinned to core 0
    assert proc.cpu_util is not None and 0.85 < proc.cpu_util <= 1.0  # always running or ready to: ~1
    assert proc.mem_used > 1 << 20  # a Python interpreter's resident memory
    assert proc.start_time == pytest.approx(psutil.Process(child.pid).create_time())


def test_a_process_pinned_by_affinity_belongs_to_its_cores_device(spawn) -> None:
    if psutil.cpu_count() < 2:
        pytest.skip("needs two cores")
    last = psutil.cpu_count() - 1
    child = spawn([sys.executable, "-c", f"import os, time\nos.sched_setaffinity(0, {{{last}}})\ntime.sleep(60)"],
                  {"FLEETLENS_WORKFLOW": "pinned"})
    deadline = time.monotonic() + 10
    while psutil.Process(child.pid).cpu_affinity() != [last]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    device, proc = _find(CpuSource(host_id="h9").sample(), child.pid)
    assert proc is not None and device.index == last


def test_busy_jobs_crowded_onto_one_core_each_read_busy_while_their_cpu_time_splits_the_core(spawn) -> None:
    # more busy jobs than the core has room for: each gets ~1/N of its CPU time, yet each is ready to run all the
    # time, and waiting for the core is the other tenants' doing, not the job's idleness
    crowd = [spawn(BUSY, {"FLEETLENS_WORKFLOW": f"crowded-{i}"}) for i in range(3)]
    procs = [psutil.Process(c.pid) for c in crowd]
    src = CpuSource(host_id="h14")
    src.sample()
    before = [sum(p.cpu_times()[:2]) for p in procs]
    t0 = time.monotonic()
    time.sleep(1.0)
    readings = src.sample()
    plain = [(sum(p.cpu_times()[:2]) - b) / (time.monotonic() - t0) for p, b in zip(procs, before, strict=True)]
    assert sum(plain) < 1.15  # one core between them: CPU time alone would read ~1/3 each
    for child in crowd:
        device, proc = _find(readings, child.pid)
        assert device.index == 0 and proc.cpu_util is not None and proc.cpu_util > 0.85


def test_run_queue_delays_are_read_per_thread_and_a_gone_process_has_none(spawn) -> None:
    threads = ("import hashlib, os, threading\nos.sched_setaffinity(0, {0})\nblock = bytes(1 << 22)\n"
               "def spin():\n    while True: hashlib.sha256(block).digest()\n"
               "for _ in range(3): threading.Thread(target=spin, daemon=True).start()\n"
               "print('ready', flush=True)\nthreading.Event().wait()\n")
    child = spawn([sys.executable, "-c", threads])
    assert child.stdout.readline() == "ready\n"
    first = thread_delays(child.pid)
    time.sleep(0.5)
    second = thread_delays(child.pid)
    assert first is not None and second is not None
    assert len(second) == 4 and set(second) == {t.id for t in psutil.Process(child.pid).threads()}
    # three threads hashing (hashlib lets go of the GIL) share core 0: each waits for it most of the time
    assert delay_growth(first, second) > 0.5
    assert delay_growth(second, first) == 0.0  # a reading never shrinks what was waited
    child.kill()
    child.wait()
    assert thread_delays(child.pid) is None


def test_a_marked_idle_process_is_reported_as_idle_not_missing(spawn) -> None:
    child = spawn(IDLE, {"FLEETLENS_MANAGED": "1"})
    src = CpuSource(host_id="h4")
    src.sample()
    time.sleep(0.2)
    _, proc = _find(src.sample(), child.pid)
    assert proc is not None and proc.cpu_util is not None and proc.cpu_util < 0.05


def test_an_unmarked_idle_process_is_not_reported(spawn) -> None:
    child = spawn(IDLE)
    src = CpuSource(host_id="h5")
    src.sample()
    time.sleep(0.2)
    assert _find(src.sample(), child.pid) == (None, None)


def test_an_unmarked_busy_process_is_a_top_consumer(spawn) -> None:
    child = spawn(BUSY)
    src = CpuSource(host_id="h6", top_n=50)
    src.sample()
    time.sleep(0.5)
    device, proc = _find(src.sample(), child.pid)
    assert device is not None and device.index == 0 and proc.cpu_util > 0.05


def test_cpu_top_processes_zero_reports_marked_jobs_only(spawn, fleet_home, monkeypatch) -> None:
    busy = spawn(BUSY)
    marked = spawn(IDLE, {"FLEETLENS_WORKFLOW": "marked"})
    monkeypatch.setenv("FLEETLENS_CPU_TOP_PROCESSES", "0")
    src = open_source(Settings(source="cpu", host_id="h10"))
    src.sample()
    time.sleep(0.5)
    readings = src.sample()
    assert _find(readings, busy.pid) == (None, None)  # busy, but nobody marked it
    assert _find(readings, marked.pid)[1] is not None
    with pytest.raises(ValueError):
        Settings(cpu_top_processes=-1)


def test_a_process_that_vanishes_is_skipped_quietly(spawn) -> None:
    child = spawn(IDLE, {"FLEETLENS_WORKFLOW": "short"})
    src = CpuSource(host_id="h7")
    assert _find(src.sample(), child.pid)[1] is not None
    child.kill()
    child.wait()
    assert _find(src.sample(), child.pid) == (None, None)


def test_open_source_auto_falls_back_to_cpu_only_without_a_gpu(fleet_home) -> None:
    source = open_source(Settings(source="auto", host_id="h8"))
    try:
        if nvml_init_error() is None:  # a GPU host: auto keeps NVML
            assert source.name == "nvml"
            return
        assert isinstance(source, CpuSource) and source.name == "cpu"
        assert source.devices()[0].uuid.startswith("cpu:h8:")
    finally:
        source.close()


def test_open_source_nvml_says_what_to_do_where_nvml_cannot_start(fleet_home) -> None:
    if nvml_init_error() is None:
        source = open_source(Settings(source="nvml"))  # a GPU host: it starts
        assert source.name == "nvml"
        source.close()
        return
    with pytest.raises(SourceUnavailable, match="FLEETLENS_SOURCE=cpu"):
        open_source(Settings(source="nvml"))


def test_open_source_replay_and_bad_names(fleet_home) -> None:
    with pytest.raises(ConfigError, match="FLEETLENS_REPLAY_PATH"):
        open_source(Settings(source="replay"))
    with pytest.raises(ConfigError, match="one of auto, nvml, cpu, replay"):
        open_source(Settings(source="tpu"))
    source = open_source(Settings(source="replay", replay_path="alibaba", replay_host="alibaba-h02"))
    assert isinstance(source, ReplaySource) and len(source.devices()) == 8


MiB = 1 << 20
# First line: the CPU mask the job had when its own code began; then it holds a known amount of memory, written
# (so it is resident), until killed.
HOLDER = ("import os, sys\nprint(sorted(os.sched_getaffinity(0)), flush=True)\n"
          "held = b'x' * (int(sys.argv[1]) << 20)\nprint('holding', flush=True)\n"
          "import time\ntime.sleep(120)\n")


def _pinned_rss(core: int) -> int:
    """RSS of the processes whose mask is exactly this core, read now (what the device should report)."""
    total = 0
    for proc in psutil.process_iter():
        try:
            if proc.cpu_affinity() == [core] and proc.pid != os.getpid():
                total += proc.memory_info().rss
        except psutil.Error:
            continue
    return total


def test_a_devices_memory_is_the_rss_of_the_jobs_pinned_to_it_and_jobs_start_pinned(tmp_path) -> None:
    if psutil.cpu_count() < 2:
        pytest.skip("needs two cores")
    last = psutil.cpu_count() - 1
    mine = os.sched_getaffinity(0)
    child = spawn_job([sys.executable, "-c", HOLDER, "300"], str(tmp_path), {"FLEETLENS_WORKFLOW": "holder"},
                      cores=[last], detach=False, base_env={"PATH": os.environ.get("PATH", "")})
    try:
        assert os.sched_getaffinity(0) == mine  # the spawning thread's own mask is put back
        proc = psutil.Process(child.pid)
        deadline = time.monotonic() + 30
        while proc.memory_info().rss < 300 * MiB:
            assert time.monotonic() < deadline and child.poll() is None
            time.sleep(0.05)
        assert proc.cpu_affinity() == [last]
        during = CpuSource(host_id="h12").sample()[last].mem_used
        rss = proc.memory_info().rss
        assert during >= rss >= 300 * MiB
        # the figure is the pinned processes' RSS, not a share of the host's used memory
        assert abs(during - _pinned_rss(last)) < 64 * MiB
    finally:
        child.kill()
        child.wait()
    after = CpuSource(host_id="h13").sample()[last].mem_used
    assert during - after >= 250 * MiB


def test_a_job_runs_its_first_line_already_pinned(tmp_path) -> None:
    if psutil.cpu_count() < 2:
        pytest.skip("needs two cores")
    last = psutil.cpu_count() - 1
    log = tmp_path / "job.log"
    child = spawn_job([sys.executable, "-c", HOLDER, "1"], str(tmp_path), {"FLEETLENS_WORKFLOW": "first-line"},
                      cores=[last], log_path=log, detach=False, base_env={"PATH": os.environ.get("PATH", "")})
    try:
        deadline = time.monotonic() + 30
        while "holding" not in log.read_text():
            assert time.monotonic() < deadline and child.poll() is None
            time.sleep(0.02)
        assert log.read_text().splitlines()[0] == f"[{last}]"
    finally:
        child.kill()
        child.wait()


def test_pinning_to_cores_the_host_does_not_allow_is_a_clear_error(tmp_path) -> None:
    mine = os.sched_getaffinity(0)
    marker = tmp_path / "started"
    with pytest.raises(InvalidInput, match=r"cannot pin .* to cpu cores \[4095\].*this host allows cores"):
        spawn_job(["/bin/touch", str(marker)], str(tmp_path), {"FLEETLENS_WORKFLOW": "nowhere"}, cores=[4095],
                  detach=False)
    assert os.sched_getaffinity(0) == mine and not marker.exists()  # nothing started, nothing changed


def test_a_job_that_reads_its_mask_at_once_always_finds_itself_pinned(tmp_path) -> None:
    # grep reads /proc/self/status within a millisecond of exec: pinning after the start would lose that race often
    if psutil.cpu_count() < 2:
        pytest.skip("needs two cores")
    last = psutil.cpu_count() - 1
    seen = []
    for i in range(20):
        log = tmp_path / f"grep-{i}.log"
        child = spawn_job(["/bin/grep", "Cpus_allowed_list", "/proc/self/status"], str(tmp_path),
                          {"FLEETLENS_WORKFLOW": "quick"}, cores=[last], log_path=log, detach=False)
        assert child.wait(timeout=30) == 0
        seen.append(log.read_text().split()[-1])
    assert seen == [str(last)] * 20
