"""A request's execution time is its batch's, which grows with the batch's size: every minute keeps its execution
times per batch-size class (store.batch_sizes), so that serving.dynamic_runtime judges the model, not the batching,
the over-provisioning replay draws each batch's time at its size, and right-sizing recovers per-request times from
batch times instead of applying the batch cost twice. Minutes stored without classes fall back to the histogram over
all sizes, and say so."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from analyzer.serving.replay import attainment_on
from analyzer.serving.rules import DYNAMIC_RUNTIME, ServingThresholds, detect_serving, dynamic_runtime
from collector import protocol as p
from collector import serving as serving_mode
from collector.serving import ServingRecorder
from collector.serving_minute import Minute
from collector.serving_sink import ServingSink
from enforcer.sim.serving.rightsize import prepare_workflow, rightsize
from store import batch_sizes as bs
from store import latency_sketch as ls
from store.db import Store
from store.errors import InvalidInput
from store.migrations import upgrade
from store.models_serving import ServingMinute
from store.serving import AppWindow, app_windows, check_minute, merge_minutes, set_slo
from store.workflows import upsert_workflow
from tests.serving.conftest import Agent


def g(b: int, alpha: float) -> float:
    return 1.0 + alpha * math.log2(b)


def _serve(rec: ServingRecorder, app: str, batches: list[tuple[int, float]], t0: float) -> None:
    """Record each batch (size, batch time) through the SDK, one request per member, back to back from t0."""
    t = t0
    for b, run in batches:
        for _ in range(b):
            rec.record(app, arrival=t, start=t, end=t + run, batch_size=b, exec_s=run)
        t += run


def test_batching_alone_never_fires_dynamic_runtime_and_a_dynamic_model_does(agent: Agent) -> None:
    rng = np.random.default_rng(0)
    alpha = 0.3
    static = []  # fixed-time model (0.1 s, 3 % jitter): alone when quiet, batches of 16 to 32 when busy
    while sum(b for b, _ in static) < 3000:
        b = 1 if rng.random() < 0.9 else int(rng.integers(16, 33))
        static.append((b, g(b, alpha) * float((0.1 * rng.lognormal(0, 0.03, b)).max())))
    dynamic = [(4, g(4, alpha) * float((0.1 * rng.lognormal(0, 1.0, 4)).max())) for _ in range(400)]
    t0 = time.time() - 1800.0
    with ServingRecorder("svc", slos={"static": 60.0, "dynamic": 60.0}, settings=agent.settings, cuda=False) as rec:
        _serve(rec, "static", static, t0)
        _serve(rec, "dynamic", dynamic, t0)
        assert rec.flush(force=True)
    assert rec.lost == 0
    agent.handlers.flush()
    now = time.time()
    with agent.store.session() as s:
        w = {x.app: x for x in app_windows(s, now - 3600.0, now)}
    st, dy = w["static"], w["dynamic"]
    # the SDK kept each request in its batch size's class: counts and batch sizes add up
    assert st.batch_sized == st.n == sum(b for b, _ in static)
    assert sum(sc.n for sc in st.exec_by_batch.values()) == st.n
    assert sum(sc.batch_sum for sc in st.exec_by_batch.values()) == st.batch_sum
    assert set(st.exec_by_batch) <= {1, 16, 32} and st.exec_by_batch[1].n == sum(b for b, _ in static if b == 1)
    # over all sizes, batching spreads the static model's times past the threshold: what the rule judged before
    assert st.exec_cv_quartiles >= 0.4
    within, covered = st.exec_cv_within_batch(20)
    assert within < 0.1 and covered == st.n
    specs = detect_serving(agent.store, now=now, record=False)
    fired = {f.subject: f for f in specs if f.rule == DYNAMIC_RUNTIME}
    assert "static" not in fired
    ev = fired["dynamic"].evidence
    assert ev["cv_basis"] == "within batch sizes" and ev["exec_cv"] >= 0.3
    assert ev["exec_cv_all_sizes"] == pytest.approx(dy.exec_cv_quartiles)
    assert ev["exec_cv_by_batch"]["4"]["requests"] == dy.n == 1600
    assert "within one batch size" in fired["dynamic"].title


def _window(by_batch: dict[int, bs.SizeClass] | None, n_unsized: int = 0, times: list[float] | None = None,
            **kw) -> AppWindow:
    """An application's window: classes as given, plus `n_unsized` requests of minutes stored without classes."""
    w = AppWindow("svc", "a", **kw)
    for sc in (by_batch or {}).values():
        ls.merge(w.exec_hist, sc.hist)
        w.n += sc.n
        w.batch_sum += sc.batch_sum
    for t in (times or [])[:n_unsized]:
        ls.add(w.exec_hist, t)
        w.n += 1
        w.batch_sum += 1
    w.exec_by_batch, w.batch_sized = dict(by_batch or {}), sum(sc.n for sc in (by_batch or {}).values())
    return w


def _class(b: int, times: list[float], per_batch: bool = True) -> bs.SizeClass:
    sc = bs.SizeClass()
    for t in times:
        ls.add(sc.hist, t, b if per_batch else 1)
        sc.n += b if per_batch else 1
        sc.batch_sum += b * (b if per_batch else 1)
    return sc


def test_minutes_stored_without_batch_sizes_are_judged_over_all_sizes_and_say_so() -> None:
    rng = np.random.default_rng(1)
    spread = [float(x) for x in rng.lognormal(np.log(0.1), 0.6, 200)]
    old = _window(None, 200, spread)
    spec = dynamic_runtime(old, ServingThresholds())
    assert spec is not None and "revision 0016" in spec.evidence["cv_basis"]
    assert "over all batch sizes" in spec.title and spec.evidence["exec_cv"] == pytest.approx(old.exec_cv_quartiles)
    # with classes, but too few requests at any one size to tell the model from batching: quiet
    thin = _window({c: _class(c, spread[i:i + 2]) for i, c in enumerate((1, 2, 3, 4, 5, 6, 7, 8))})
    assert thin.n >= 50 and thin.exec_cv_within_batch(20)[1] == 0
    assert dynamic_runtime(thin, ServingThresholds()) is None


def test_the_replay_draws_each_batch_time_at_its_batch_size() -> None:
    """Requests mostly alone (0.1 s), some in batches of two (2 s): the replay's batches of one (the mean size)
    take 0.1 s, not a draw from all sizes, where the 2 s batches hold 37.5 % of the requests."""
    minutes = [(float(m * 60), 160, 0, None) for m in range(10)]
    w = _window({1: _class(1, [0.1] * 1000), 2: _class(2, [2.0] * 300)}, slo_s=0.5, target=0.99, minutes=minutes)
    assert round(w.batch_sum / w.n) == 1
    assert attainment_on([w], 1)["a"] >= 0.99
    unsized = _window(None, minutes=minutes, slo_s=0.5, target=0.99)  # the same times, stored without classes
    unsized.exec_hist, unsized.n, unsized.batch_sum = dict(w.exec_hist), w.n, w.batch_sum
    assert attainment_on([unsized], 1)["a"] < 0.5


def _minute_rec(minute: float, own: np.ndarray, alpha: float) -> dict:
    """A minute of batches (rows of `own`, each request's own time), each running g(b) x its longest member."""
    b = own.shape[1]
    bt = g(b, alpha) * own.max(axis=1)
    h: dict[int, int] = {}
    for t in bt:
        ls.add(h, float(t), b)
    n = own.size
    return {"app": "a", "minute": minute, "n": n, "dropped": 0, "met": None, "exec_sum": float(bt.sum()) * b,
            "exec_sumsq": float((bt * bt).sum()) * b, "wait_sum": 0.0, "latency_sum": float(bt.sum()) * b,
            "batch_sum": n * b, "exec_hist": ls.to_json(h), "latency_hist": ls.to_json(h),
            "exec_by_batch": {str(b): {"n": n, "batch_sum": n * b, "hist": ls.to_json(h)}}}


def test_rightsize_recovers_per_request_times_from_batch_times(sqlite_store: Store) -> None:
    """Requests recorded in batches of 8 with known own times: the recovered per-request median is within a few % of
    theirs (the batch times' median is 1.9x it), and no more devices are needed than with the own times themselves
    (recorded alone)."""
    upgrade(sqlite_store)
    alpha, now = 0.1, 1_800_000_000.0
    rng = np.random.default_rng(0)
    own = [0.2 * rng.lognormal(0, 0.3, (150, 8)) for _ in range(10)]
    with sqlite_store.session() as s:
        for wf, b in (("batched", 8), ("truth", 1)):
            upsert_workflow(s, wf)
            set_slo(s, wf, "a", 1.0)
            merge_minutes(s, wf, [_minute_rec(now - (10 - i) * 60.0, o.reshape(-1, b), alpha)
                                  for i, o in enumerate(own)], devices=8)
    true_median = float(np.median(np.concatenate([o.ravel() for o in own])))
    batched, slo, held = prepare_workflow(sqlite_store, "batched", now=now, alpha=alpha)
    truth, _, _ = prepare_workflow(sqlite_store, "truth", now=now, alpha=alpha)
    assert held == 8 and batched.time_basis == {} and len(batched.arrival) == len(truth.arrival) == 12_000
    assert batched.dists.median[0] == pytest.approx(true_median, rel=0.04)
    assert truth.dists.median[0] == pytest.approx(true_median, rel=0.02)
    with sqlite_store.session() as s:
        (w,) = app_windows(s, now - 3600.0, now, ["batched"])
    assert ls.quantiles(w.exec_hist, (0.5,))[0] > 1.8 * true_median  # what was fit before: batch times
    need = {name: rightsize(prep, slo, alpha=alpha, target=0.99, schedulers=("ours",)).needed["ours"]
            for name, prep in (("batched", batched), ("truth", truth))}
    assert need["batched"] is not None and need["batched"] <= need["truth"]


def test_rightsize_says_when_an_application_has_no_batch_sizes(sqlite_store: Store) -> None:
    upgrade(sqlite_store)
    now = 1_800_000_000.0
    rec = _minute_rec(now - 120.0, np.full((50, 2), 0.1), 0.1)
    with sqlite_store.session() as s:
        upsert_workflow(s, "svc")
        set_slo(s, "svc", "a", 1.0)
        merge_minutes(s, "svc", [{**rec, "exec_by_batch": None}], devices=2)
        merge_minutes(s, "svc", [{**rec, "minute": now - 60.0}], devices=2)
    prep, _, _ = prepare_workflow(sqlite_store, "svc", now=now, window_s=60.0)
    assert prep.time_basis == {}  # the newest minute has them
    prep, _, _ = prepare_workflow(sqlite_store, "svc", now=now)
    assert "100 of its 200 requests" in prep.time_basis["a"]
    prep, _, _ = prepare_workflow(sqlite_store, "svc", now=now - 60.0, window_s=60.0)
    assert "stored before revision 0016" in prep.time_basis["a"] and "overstated" in prep.time_basis["a"]


def _rec(n_by_class: dict[int, list[float]]) -> dict:
    """A minute record whose classes hold the given times (one request each, at the class's smallest size)."""
    eh: dict[int, int] = {}
    classes = {}
    n = batch_sum = 0
    for c, times in n_by_class.items():
        h: dict[int, int] = {}
        for t in times:
            ls.add(h, t)
            ls.add(eh, t)
        size = bs.class_sizes(c)[0]
        classes[str(c)] = {"n": len(times), "batch_sum": size * len(times), "hist": ls.to_json(h)}
        n += len(times)
        batch_sum += size * len(times)
    return {"app": "a", "minute": 60.0, "n": n, "dropped": 0, "met": None, "exec_sum": sum(eh.values()) * 0.1,
            "exec_sumsq": 0.0, "wait_sum": 0.0, "latency_sum": 1.0, "batch_sum": batch_sum,
            "exec_hist": ls.to_json(eh), "latency_hist": ls.to_json(eh), "exec_by_batch": classes}


def test_batch_size_classes_are_checked_merged_and_summed(any_store: Store) -> None:
    assert [bs.size_class(b) for b in (1, 8, 9, 16, 17, 32, 33, 1 << 16, (1 << 16) + 1, 10**12)] == [
        1, 8, 16, 16, 32, 32, 64, 1 << 16, 1 << 16, 1 << 16]
    assert len(bs.CLASSES) == 21 and bs.class_label(16) == "9-16" and bs.class_label(1 << 16) == ">32768"
    good = _rec({1: [0.1, 0.2], 16: [0.5]})
    for bad, why in [
        ({**good, "n": 4, "exec_hist": {**good["exec_hist"], "0": 1}, "latency_hist": {**good["exec_hist"], "0": 1}},
         "exec_by_batch counts 3 requests, n says 4"),
        ({**good, "batch_sum": 99}, "batch sizes add up to 11, batch_sum says 99"),
        ({**good, "exec_by_batch": {**good["exec_by_batch"], "12": good["exec_by_batch"]["16"]}},
         "'12' is not a batch-size class"),
        ({**good, "exec_by_batch": {"1": {**good["exec_by_batch"]["1"], "n": 3}, "16": good["exec_by_batch"]["16"]}},
         "class 1's histogram counts 2 requests, its n says 3"),
        ({**good, "exec_by_batch": {"1": good["exec_by_batch"]["1"], "16": {**good["exec_by_batch"]["16"],
                                                                           "batch_sum": 17}}},
         "class 16 holds batch sizes 9-16, so its 1 requests' batch sizes cannot add up to 17"),
        ({**good, "exec_by_batch": [1]}, "must map batch-size classes"),
    ]:
        with pytest.raises(InvalidInput, match=why):
            check_minute(bad)
    upgrade(any_store)
    with any_store.session() as s:
        upsert_workflow(s, "svc")
    # a bad record refuses the whole call: nothing of it is stored
    with pytest.raises(InvalidInput, match="batch_sum says 99"), any_store.session() as s:
        merge_minutes(s, "svc", [good, {**good, "minute": 120.0, "batch_sum": 99}])
    with any_store.session() as s:
        assert s.query(ServingMinute).count() == 0
    # two parts of a minute add up; a part recorded without classes (an SDK from before them) leaves none
    sink = ServingSink()
    sink.handle({"workflow": "svc", "pid": 1, "minutes": [good, _rec({1: [0.3], 2: [0.4]})]})
    sink.handle({"workflow": "svc", "pid": 1, "minutes": [{**good, "minute": 120.0}]})
    sink.write(any_store)
    with any_store.session() as s:
        merge_minutes(s, "svc", [_rec({16: [0.6]})])  # into the first minute's row
        merge_minutes(s, "svc", [{**good, "minute": 120.0, "exec_by_batch": None}])
    with any_store.session() as s:
        rows = {r.minute: r.exec_by_batch for r in s.query(ServingMinute)}
        (w,) = app_windows(s, 0.0, 1000.0)
    assert rows[120.0] is None
    assert {c: (v["n"], v["batch_sum"]) for c, v in rows[60.0].items()} == {"1": (3, 3), "2": (1, 2), "16": (2, 18)}
    assert (w.n, w.batch_sized) == (12, 6)
    assert {c: (sc.n, ls.total(sc.hist)) for c, sc in w.exec_by_batch.items()} == {1: (3, 3), 2: (1, 1), 16: (2, 2)}


def test_messages_stay_under_the_line_limit_whatever_batch_sizes_and_times_occur(fleet_home, monkeypatch) -> None:
    """Minutes with every class full (a histogram of ~1,750 buckets each: 1 ns to ten days) no longer fit fifty to
    a message: the SDK sizes messages by what they hold; one minute larger than a message on its own (times over
    every order of magnitude) goes without its classes. The agent takes every message; no request is lost."""
    from store.settings import get_settings

    rec = ServingRecorder("svc", settings=get_settings(fresh=True), cuda=False)
    lo, hi = ls.bucket(1e-9), ls.bucket(10 * 86400.0)
    full = {k: 1 for k in range(lo, hi + 1)}
    minutes, per_minute = 12, len(full) * len(bs.CLASSES)
    for i in range(minutes):
        m = Minute(judged=False)
        for c in bs.CLASSES:
            size = bs.class_sizes(c)[0]
            m.by_batch[c] = [len(full), size * len(full), dict(full)]
            m.n += len(full)
            m.batch_sum += size * len(full)
            ls.merge(m.exec_hist, full)
            ls.merge(m.latency_hist, full)
        rec._pending[("a", 60.0 * i)] = m
    huge = Minute(judged=False)  # one minute with times over the whole range of doubles, in every class
    every = {k: 1 for k in range(ls.MIN_BUCKET, ls.MAX_BUCKET + 1, 10)}
    for c in bs.CLASSES:
        huge.by_batch[c] = [len(every), bs.class_sizes(c)[0] * len(every), dict(every)]
        huge.n += len(every)
        huge.batch_sum += bs.class_sizes(c)[0] * len(every)
        ls.merge(huge.exec_hist, every)
        ls.merge(huge.latency_hist, every)
    rec._pending[("b", 0.0)] = huge
    sink = ServingSink()
    sent = []
    while (msg := rec._next_message()) is not None:
        line = p.encode(msg.msg)
        assert len(line) < p.MAX_LINE
        sink.handle(p.decode(line))
        sent.append(msg)
    assert len(sent) > 1 and len(sent[0].msg["minutes"]) < serving_mode.MINUTES_PER_MESSAGE
    assert sum(msg.requests for msg in sent) == sink.pending() == minutes * per_minute + huge.n
    by_app = {(r["app"], r["minute"]): r["exec_by_batch"] for msg in sent for r in msg.msg["minutes"]}
    assert by_app[("b", 0.0)] is None  # too large with its classes: sent without them
    assert all(v is not None and len(v) == len(bs.CLASSES) for k, v in by_app.items() if k[0] == "a")
    rec._conn.close()
