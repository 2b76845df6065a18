"""Agents on several hosts write the same rows at the same instant: a multi-host job's workflow, a replicated serving
workflow's minutes and its raw-request counts. Each agent here is a thread with its own Store (its own connections),
all writing at once; every registration succeeds, and every count adds up exactly."""

from __future__ import annotations

import threading

import pytest
from sqlalchemy import func, select

from collector.agent_store import touch_new_workflows
from collector.sdk_memory import record_workflow_memory
from collector.serving_sink import ServingSink
from store.db import Store
from store.device_memory import CONTEXT_LABEL, HOST_MEMORY_PREFIX, MEM_STEPS_LABEL
from store.models import Workflow
from store.rows import merge_labels
from store.serving import app_windows
from store.serving_raw import raw_counts
from store.settings import Settings
from store.workflows import upsert_workflow

AGENTS = 3


def _together(work) -> list[BaseException]:
    """Run work(agent_index, barrier) on AGENTS threads at once; the exceptions they raised."""
    barrier = threading.Barrier(AGENTS)
    failed: list[BaseException] = []

    def run(k: int) -> None:
        try:
            work(k, barrier)
        except BaseException as exc:
            failed.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(k,)) for k in range(AGENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    return failed


def test_agents_registering_one_workflow_at_once_all_succeed(any_store: Store) -> None:
    url = any_store.url

    def register(k: int, barrier: threading.Barrier) -> None:
        store = Store(url)
        try:
            for i in range(30):
                barrier.wait(timeout=60)  # all agents meet the new workflow in the same instant
                if k % 2:  # the job SDK's path (a rank's first step summary)
                    with store.session() as s:
                        upsert_workflow(s, f"job-{i}", id_source="env", now=1000.0 + k)
                else:  # the agent's path (a process of the job seen on its host)
                    touch_new_workflows(store, {f"job-{i}": "env"}, set())
        finally:
            store.dispose()

    assert _together(register) == []
    with any_store.session() as s:
        assert s.scalar(select(func.count()).select_from(Workflow)) == 30


def test_agents_adding_into_one_serving_workflow_at_once_lose_no_request(any_store: Store) -> None:
    url = any_store.url
    rounds, raw_each, cap = 60, 3, 100
    settings = Settings(serving_raw_requests=True, serving_raw_max_rows=cap)
    slos = {"txt2img": 2.0, "img2img": 3.0}

    def serve(k: int, barrier: threading.Barrier) -> None:
        store = Store(url)
        sink = ServingSink(settings)
        try:
            for r in range(rounds):
                minute = 60.0 * (r // 10)  # ten rounds a minute: every agent adds into the same rows
                sink.handle({"workflow": "sd-api", "devices": 1 + k, "slos": slos, "minutes": [
                    {"app": app, "minute": minute, "n": 2, "dropped": 1, "met": 1, "exec_sum": 0.5,
                     "exec_hist": {"10": 2}, "latency_hist": {"12": 2}} for app in ("txt2img", "img2img")],
                    "raw": [["txt2img", minute + r % 10 + j / 10, 0.0, 0.25, 0.25, 1] for j in range(raw_each)]})
                barrier.wait(timeout=60)
                sink.write(store)
        finally:
            store.dispose()

    assert _together(serve) == []
    with any_store.session() as s:
        windows = {w.app: w for w in app_windows(s, 0.0, 3600.0, ["sd-api"])}
        sent = rounds * AGENTS
        for app in ("txt2img", "img2img"):
            w = windows[app]
            assert (w.n, w.dropped, w.met_exact, w.devices) == (2 * sent, sent, sent, AGENTS)
            assert sum(w.exec_hist.values()) == sum(w.latency_hist.values()) == w.n  # histograms merged, not replaced
        assert (windows["txt2img"].slo_s, windows["img2img"].slo_s) == (2.0, 3.0)  # the SLOs all reported at once
        stored, over = raw_counts(s, "sd-api")
    assert stored == cap and stored + over == rounds * raw_each * AGENTS


def test_a_workflow_seen_later_by_another_agent_is_never_marked_seen_earlier(any_store: Store) -> None:
    """An agent reads the workflow, another host's agent marks it seen later and commits, then the first writes its
    own, earlier sighting: last_seen keeps the later one (it is compared with the row as committed, not as read)."""
    with any_store.session() as s:
        upsert_workflow(s, "job", id_source="env", now=100.0)
    slow = Store(any_store.url)
    try:
        with slow.session() as s:
            read = s.get(Workflow, "job")  # read before the other agent writes (and held: the session keeps it)
            assert read.last_seen == 100.0
            with any_store.session() as other:
                upsert_workflow(other, "job", now=200.0)
            assert upsert_workflow(s, "job", team="vision", now=150.0) is read
            assert read.last_seen == 200.0
    finally:
        slow.dispose()
    with any_store.session() as s:
        wf = s.get(Workflow, "job")
        assert (wf.last_seen, wf.team) == (200.0, "vision")
        upsert_workflow(s, "job", now=300.0)
    with any_store.session() as s:
        assert s.get(Workflow, "job").last_seen == 300.0


def test_labels_another_agent_set_since_the_row_was_read_are_kept(any_store: Store) -> None:
    """One agent reads a workflow, another host's agent sets a label and commits, then the first sets its own labels:
    both agents' keys are on the row (merged with the row as committed, not written back from the stale copy)."""
    with any_store.session() as s:
        upsert_workflow(s, "job", id_source="env", now=1.0, labels={"team_hint": "vision"})
    slow = Store(any_store.url)
    try:
        with slow.session() as s:
            read = s.get(Workflow, "job")
            assert read.labels == {"team_hint": "vision"}
            with any_store.session() as other:
                record_workflow_memory(other, "job", "host-b", (None, None, None, 0), 512 << 20)
            record_workflow_memory(s, "job", "host-a", (4 << 30, 1 << 30, "cuda", 40), None)
            assert read.labels[CONTEXT_LABEL] == 512 << 20  # the object is read back after the merge
    finally:
        slow.dispose()
    with any_store.session() as s:
        wf = s.get(Workflow, "job")
        assert wf.labels == {"team_hint": "vision", CONTEXT_LABEL: 512 << 20, "mem_source": "cuda",
                             MEM_STEPS_LABEL: 40, HOST_MEMORY_PREFIX + "host-a": [4 << 30, 1 << 30, "cuda", 40, None],
                             HOST_MEMORY_PREFIX + "host-b": [None, None, None, 0, 512 << 20]}
        assert (wf.mem_persistent, wf.mem_ephemeral) == (4 << 30, 1 << 30)
        for bad in (None, {"nested": 1}):
            with pytest.raises(ValueError, match="must be set, and be a scalar or a list"):
                merge_labels(s, wf, {"trial": bad})


def test_a_job_on_several_hosts_is_sized_by_its_largest_rank_whatever_order_the_agents_write_in(
        any_store: Store) -> None:
    """Each host's agent records its ranks' memory at once, round after round: the row carries the largest P and E
    of any host (not the last writer's), the most steps, and the largest C; every host's own entry is kept."""
    with any_store.session() as s:
        upsert_workflow(s, "ddp", id_source="env", now=1.0)
    url = any_store.url
    GiB = 1 << 30

    def record(k: int, barrier: threading.Barrier) -> None:
        store = Store(url)
        try:
            for rnd in range(1, 11):
                barrier.wait(timeout=60)
                # host k's ranks hold (k + 1) GiB and a little more each round; host 0's have seen the most steps
                with store.session() as s:
                    record_workflow_memory(s, "ddp", f"host-{k}", ((k + 1) * GiB + rnd, GiB // (k + 1) + rnd, "cuda",
                                                                   rnd * (10 if k == 0 else 1)), ((k + 1) << 20) + rnd)
        finally:
            store.dispose()

    assert _together(record) == []
    with any_store.session() as s:
        wf = s.get(Workflow, "ddp")
        assert (wf.mem_persistent, wf.mem_ephemeral) == (AGENTS * GiB + 10, GiB + 10)  # the last round's largest
        assert (wf.labels["mem_source"], wf.labels[MEM_STEPS_LABEL], wf.labels[CONTEXT_LABEL]) == \
            ("cuda", 100, (AGENTS << 20) + 10)
        assert {k for k in wf.labels if k.startswith(HOST_MEMORY_PREFIX)} == \
            {f"{HOST_MEMORY_PREFIX}host-{k}" for k in range(AGENTS)}
        # a host whose job measures host memory only (no CUDA) does not replace the CUDA figures, however large
        record_workflow_memory(s, "ddp", "host-cpu", (64 * GiB, 0, "rss", 500), None)
    with any_store.session() as s:
        wf = s.get(Workflow, "ddp")
        assert (wf.mem_persistent, wf.labels["mem_source"], wf.labels[MEM_STEPS_LABEL]) == \
            (AGENTS * GiB + 10, "cuda", 100)
