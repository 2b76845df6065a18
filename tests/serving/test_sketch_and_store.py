"""Latency histograms: exact counts, quantiles within 1 %, merged without loss; the store's minute rows add up and
refuse bad records with a reason."""

from __future__ import annotations

import numpy as np
import pytest

from store import latency_sketch as ls
from store.errors import InvalidInput
from store.migrations import upgrade
from store.serving import app_windows, check_minute, merge_minutes, set_slo
from store.workflows import upsert_workflow


def test_quantiles_are_within_one_percent_and_counts_exact() -> None:
    rng = np.random.default_rng(0)
    x = rng.lognormal(np.log(0.2), 0.8, 50_000)
    h: dict[int, int] = {}
    for v in x:
        ls.add(h, float(v))
    assert ls.total(h) == len(x)
    qs = (0.01, 0.5, 0.9, 0.99, 0.999)
    got = ls.quantiles(h, qs)
    s = np.sort(x)
    for q, g in zip(qs, got, strict=True):
        want = s[int(np.floor(q * (len(s) - 1)))]
        assert abs(g - want) / want <= ls.RELATIVE_ERROR + 1e-12
    # merging two halves is the histogram of the whole
    a: dict[int, int] = {}
    b: dict[int, int] = {}
    for v in x[:20_000]:
        ls.add(a, float(v))
    for v in x[20_000:]:
        ls.add(b, float(v))
    assert ls.merge(a, ls.to_json(b)) == h


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_a_time_that_is_not_positive_and_finite_is_refused(bad: float) -> None:
    with pytest.raises(InvalidInput):
        ls.add({}, bad)


def _rec(app: str, minute: float, times: list[float], **kw) -> dict:
    eh: dict[int, int] = {}
    for t in times:
        ls.add(eh, t)
    return {"app": app, "minute": minute, "n": len(times), "dropped": kw.get("dropped", 0), "met": kw.get("met"),
            "exec_sum": sum(times), "exec_sumsq": sum(t * t for t in times), "wait_sum": 0.0,
            "latency_sum": sum(times), "batch_sum": len(times), "exec_hist": ls.to_json(eh),
            "latency_hist": ls.to_json(eh)}


def test_minute_rows_merge_across_flushes_and_bad_records_are_refused(any_store) -> None:
    upgrade(any_store)
    with any_store.session() as s:
        upsert_workflow(s, "svc")
        set_slo(s, "svc", "a", 0.5)
        merge_minutes(s, "svc", [_rec("a", 120.0, [0.1, 0.2], met=2)], devices=2)
        merge_minutes(s, "svc", [_rec("a", 150.0, [0.9], met=0, dropped=3)], devices=1)  # same minute
    with any_store.session() as s:
        (w,) = app_windows(s, 0.0, 1000.0)
    assert (w.n, w.dropped, w.met(), w.devices, w.slo_s) == (3, 3, 2, 2, 0.5)
    assert w.attainment() == pytest.approx(2 / 6)  # shed requests count as misses
    assert w.minutes == [(120.0, 3, 3, 2)]
    for bad, why in [({**_rec("a", 0, [0.1]), "app": ""}, "no application"),
                     ({**_rec("a", 0, [0.1]), "n": 2}, "counts 1 requests, n says 2"),
                     ({**_rec("a", 0, [0.1]), "dropped": -1}, "dropped"),
                     ({**_rec("a", 0, [0.1]), "met": 5}, "met")]:
        with pytest.raises(InvalidInput, match=why):
            check_minute(bad)
