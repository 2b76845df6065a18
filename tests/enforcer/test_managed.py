"""`fleetlens run`: managed jobs registered with their command line, placed under the policy on the host's devices,
started with the device / lane environment (real child processes, real CPU affinity); bad input writes nothing."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import pytest
from sqlalchemy import func, select

import enforcer.managed
import ui.cli
from enforcer.managed import PlacementError, register_managed
from store.db import Store
from store.headroom import charged
from store.migrations import upgrade
from store.models import Host, Lane, Placement, Workflow
from store.registry import DeviceSpec, register_devices, register_host
from store.settings import get_settings
from tests.conftest import PROJECT_ROOT

PROBE = ("import json, os, sys; "
         "keys = ['FLEETLENS_WORKFLOW', 'FLEETLENS_MANAGED', 'CUDA_VISIBLE_DEVICES', 'FLEETLENS_LANE', "
         "'FLEETLENS_MEMORY_FRACTION', 'CUDA_MPS_ACTIVE_THREAD_PERCENTAGE']; "
         "out = {k: os.environ.get(k) for k in keys}; out['affinity'] = sorted(os.sched_getaffinity(0)); "
         "open(sys.argv[1], 'w').write(json.dumps(out)); sys.exit(int(sys.argv[2]))")
DEVICE_BYTES = 8 << 30


@pytest.fixture
def host(fleet_home: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Store, dict[int, int]]:
    """A host registered with two cpu devices (core 0 and core 1), as its agent would have done."""
    monkeypatch.setenv("FLEETLENS_HOST_ID", "h1")
    settings = get_settings(fresh=True)
    settings.ensure_home()
    store = Store.from_settings(settings)
    upgrade(store)
    with store.session() as s:
        register_host(s, "h1", hostname="h1", source="cpu")
        ids = register_devices(s, "h1", [DeviceSpec(i, f"cpu:h1:{i}", f"cpu core {i}", DEVICE_BYTES, (i,))
                                         for i in range(2)], source="cpu")
    yield store, ids
    store.dispose()


def probe(tmp_path: Path, *options: str, exit_code: int = 0) -> tuple[int, dict]:
    out = tmp_path / "env.json"
    code = ui.cli.run(["run", *options, "--", sys.executable, "-c", PROBE, str(out), str(exit_code)])
    return code, json.loads(out.read_text()) if out.exists() else {}


def count(store: Store, model: type) -> int:
    with store.session() as s:
        return s.scalar(select(func.count()).select_from(model))


def test_foreground_run_places_a_whole_device_and_returns_the_jobs_exit_code(host, tmp_path: Path) -> None:
    store, ids = host
    code, env = probe(tmp_path, "--name", "fg", "--steps", "123", "--team", "vision", exit_code=3)
    assert code == 3
    with store.session() as s:
        wf = s.scalar(select(Workflow))
        placement = s.scalar(select(Placement))
        assert wf.id.startswith("fg-") and wf.managed and wf.id_source == "managed" and not wf.movable
        assert wf.command[-3:] == [PROBE, str(tmp_path / "env.json"), "3"] and wf.cwd == str(Path.cwd())
        assert wf.declared_steps == 123 and wf.team == "vision" and wf.state == "failed"
        assert Path(wf.checkpoint_dir).is_dir() and wf.checkpoint_dir.startswith(str(get_settings().checkpoint_dir))
        assert placement.workflow_id == wf.id and placement.lane_id is None and placement.state == "ended"
        device_index = {v: k for k, v in ids.items()}[placement.device_id]
    assert env["FLEETLENS_WORKFLOW"] == wf.id and env["FLEETLENS_MANAGED"] == "h1"
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["FLEETLENS_LANE"] is None
    assert env["affinity"] == [device_index]  # pinned to the cpu device's core


def test_lane_auto_starts_the_job_in_a_lane_with_its_memory_fraction_and_compute_share(host, tmp_path: Path) -> None:
    store, _ = host
    code, env = probe(tmp_path, "--lane", "auto", "--mem-mb", "100", "--movable")
    assert code == 0
    with store.session() as s:
        lane = s.scalar(select(Lane))
        placement = s.scalar(select(Placement))
        assert placement.lane_id == lane.id and lane.state == "closed"  # the job ended: its lane closed
        assert placement.mem_persistent == 100 << 20  # P as measured (declared); the lane charged it 1.1 P
        assert s.scalar(select(Workflow)).movable
        share = charged(placement.mem_persistent) + placement.mem_ephemeral
    assert env["FLEETLENS_LANE"] == str(lane.id)
    # the job's own admitted share (P' + E), not the whole lane (which has Salus's 5 % headroom on top)
    assert float(env["FLEETLENS_MEMORY_FRACTION"]) == pytest.approx(share / DEVICE_BYTES, rel=1e-4)
    assert share < lane.size_bytes
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == str(round(lane.compute_share * 100))


def test_the_policy_decides_where_lane_jobs_go(host) -> None:
    store, _ = host
    settings = get_settings()

    def place(policy: str, util: float):
        return register_managed(store, [sys.executable, "-c", "pass"], settings=settings, lane="auto",
                                mem_bytes=100 << 20, util=util, policy=policy, cwd=PROJECT_ROOT)

    a, b = place("pack", 0.2), place("pack", 0.2)
    assert a.device_ids == b.device_ids  # PACK: light jobs onto the device already in use
    c = place("fair", 0.2)
    assert c.device_ids != a.device_ids  # FAIR: spread onto the least loaded device
    with store.session() as s:
        assert s.scalar(select(func.count()).select_from(Lane).where(Lane.state == "open")) == 3
        shares = sorted(lane.compute_share for lane in s.scalars(select(Lane)))
        assert shares[0] == pytest.approx(0.2)


def test_whole_devices_are_exclusive_and_a_full_host_is_a_clear_error(host) -> None:
    store, ids = host
    settings = get_settings()
    cmd = [sys.executable, "-c", "pass"]
    both = register_managed(store, cmd, settings=settings, gpus=2, cwd=PROJECT_ROOT)
    assert sorted(both.device_ids) == sorted(ids.values()) and both.lane_id is None
    workflows = count(store, Workflow)
    with pytest.raises(PlacementError, match="no device on host 'h1' has room"):
        register_managed(store, cmd, settings=settings, gpus=1, name="late", cwd=PROJECT_ROOT)
    with pytest.raises(PlacementError):
        register_managed(store, cmd, settings=settings, lane="auto", name="late", cwd=PROJECT_ROOT)
    assert count(store, Workflow) == workflows  # nothing written for the jobs that found no room


@pytest.mark.parametrize(("options", "message"), [
    (["--policy", "bogus"], "unknown policy 'bogus'"),
    (["--gpus", "1", "--lane", "auto"], "not both"),
    (["--lane", "3"], "--lane takes 'auto'"),
    (["--gpus", "0"], "at least 1"),
])
def test_bad_options_are_one_line_errors_and_write_nothing(host, options, message, capsys) -> None:
    store, _ = host
    code = ui.cli.run(["run", *options, "--", sys.executable, "-c", "pass"])
    assert code == 2
    assert message in capsys.readouterr().err
    assert count(store, Workflow) == count(store, Placement) == 0


def test_an_unwritable_checkpoint_folder_is_refused_before_anything_is_written(host, capsys) -> None:
    store, _ = host
    get_settings().checkpoint_dir.parent.mkdir(parents=True, exist_ok=True)
    get_settings().checkpoint_dir.write_text("a file where the checkpoint folders should go")
    code = ui.cli.run(["run", "--", sys.executable, "-c", "pass"])
    assert code == 2
    assert "checkpoint folder" in capsys.readouterr().err
    assert count(store, Workflow) == count(store, Placement) == 0


def test_a_host_without_devices_or_without_an_agent_is_a_clear_error(host, monkeypatch, capsys) -> None:
    store, _ = host
    with store.session() as s:  # the host's agent was last heard of long ago
        s.get(Host, "h1").last_seen -= 3600
    # detached with no agent running on the host: the placement is withdrawn again
    code = ui.cli.run(["run", "--detach", "--lane", "auto", "--mem-mb", "100", "--", sys.executable, "-c", "pass"])
    assert code == 2 and "no fleetlens agent is running on host 'h1'" in capsys.readouterr().err
    with store.session() as s:
        assert [p.state for p in s.scalars(select(Placement))] == ["ended"]
        assert [lane.state for lane in s.scalars(select(Lane))] == ["closed"]
    monkeypatch.setenv("FLEETLENS_HOST_ID", "nowhere")
    code = ui.cli.run(["run", "--", sys.executable, "-c", "pass"])
    assert code == 2 and "host 'nowhere' has no registered devices" in capsys.readouterr().err


def test_no_command_is_a_clear_error(host, capsys) -> None:
    assert ui.cli.run(["run", "--name", "x"]) == 2
    assert "no command to run" in capsys.readouterr().err


def test_drive_with_nothing_to_do_says_so(host, capsys) -> None:
    assert ui.cli.run(["drive"]) == 0
    assert "no unfinished actions" in capsys.readouterr().out


def test_devices_restricts_the_placement_and_refuses_foreign_devices(sqlite_store, fleet_home):
    from store.errors import NotFound
    from store.registry import DeviceSpec, register_devices, register_host

    with sqlite_store.session() as s:
        register_host(s, "pin-host", hostname="pin-host", source="cpu")
        ids = register_devices(s, "pin-host", [DeviceSpec(i, f"pin-{i}", f"cpu {i}", 8 << 30) for i in range(3)],
                               source="cpu")
    job = register_managed(sqlite_store, ["python", "x.py"], settings=get_settings(),
                           lane="auto", host_id="pin-host", devices=[ids[2]],
                           name="pinned")
    assert job.device_ids == [ids[2]]
    with pytest.raises(NotFound, match="not on host"):
        register_managed(sqlite_store, ["python", "x.py"], settings=get_settings(),
                         host_id="pin-host", devices=[999_999], name="lost")


def test_two_runs_started_at_once_never_take_the_same_device(any_store: Store, fleet_home: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Both runs read the host's free devices at the same moment unless placement is serialised per host; the
    barrier holds the first reader until the second has read too (or gives up after a second, when it cannot)."""
    with any_store.session() as s:
        register_host(s, "race", hostname="race", source="cpu")
        register_devices(s, "race", [DeviceSpec(0, "race-0", "cpu 0", DEVICE_BYTES, (0,))], source="cpu")
    barrier = threading.Barrier(2)
    load = enforcer.managed.load_host_fleet

    def load_together(session, host_id, settings):
        fleet = load(session, host_id, settings)
        try:
            barrier.wait(timeout=1.0)
        except threading.BrokenBarrierError:
            pass
        return fleet

    monkeypatch.setattr(enforcer.managed, "load_host_fleet", load_together)
    outcomes: list[object] = []

    def run(name: str) -> None:
        try:
            outcomes.append(register_managed(any_store, ["python", "x.py"], settings=get_settings(),
                            host_id="race", name=name))
        except Exception as exc:  # noqa: BLE001  (the outcome is what the test checks)
            outcomes.append(exc)

    threads = [threading.Thread(target=run, args=(f"racer-{i}",)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    placed = [o for o in outcomes if not isinstance(o, Exception)]
    refused = [o for o in outcomes if isinstance(o, Exception)]
    assert len(placed) == 1 and len(refused) == 1, outcomes
    assert isinstance(refused[0], PlacementError) and "no device on host 'race' has room" in str(refused[0])
    with any_store.session() as s:
        held = list(s.scalars(select(Placement).where(Placement.state.in_(("active", "pending")))))
    assert [p.workflow_id for p in held] == [placed[0].workflow_id]


def test_lane_mates_are_each_capped_at_their_own_share_and_a_share_below_measured_memory_is_refused(host) -> None:
    from collector.launch import job_env
    from store.errors import InvalidInput
    from store.workflows import upsert_workflow

    store, ids = host
    device_id = ids[0]
    shares = {"big": (300 << 20, 40 << 20), "small": (100 << 20, 20 << 20)}  # P and E as admitted
    with store.session() as s:
        lane = Lane(device_id=device_id, size_bytes=520 << 20, compute_share=0.5, state="open", created_at=1.0)
        s.add(lane)
        s.flush()
        for name, (p, e) in shares.items():
            upsert_workflow(s, name, now=1.0, id_source="managed", managed=True, state="running")
            s.add(Placement(workflow_id=name, device_id=device_id, lane_id=lane.id, host_id="h1",
                            mem_persistent=p, mem_ephemeral=e, state="active", started_at=1.0))
        s.flush()
        fractions = {}
        for name, (p, e) in shares.items():
            env, _ = job_env(s, name, [device_id], lane.id, host_id="h1")
            fractions[name] = float(env["FLEETLENS_MEMORY_FRACTION"])
            assert fractions[name] == pytest.approx((charged(p) + e) / DEVICE_BYTES, rel=1e-4)  # P' + E
        # each is capped at its own share, so together they stay inside the lane (the lane's size each would not)
        assert sum(fractions.values()) * DEVICE_BYTES <= lane.size_bytes
        # the job grew since it was admitted: its share no longer holds its persistent memory
        small = s.get(Workflow, "small")
        small.mem_persistent, small.labels = 200 << 20, {"mem_source": "rss"}
        s.flush()
        job_env(s, "small", [device_id], lane.id, host_id="h1")  # host memory on a CPU: no GPU share to compare
        small.labels = {"mem_source": "cuda"}
        s.flush()
        with pytest.raises(InvalidInput, match="less than the 209715200 bytes of persistent memory"):
            job_env(s, "small", [device_id], lane.id, host_id="h1")
