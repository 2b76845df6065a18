"""A serving workflow in a store for the Serving page's tests: two applications' minutes (real histograms of
seeded lognormal times), their SLOs, four devices held under light load."""

from __future__ import annotations

import time

import numpy as np

from store import latency_sketch as ls
from store.db import Store
from store.serving import merge_minutes, set_slo
from store.workflows import upsert_workflow

WORKFLOW = "sd-api"


def seed_serving(store: Store, now: float | None = None, minutes: int = 20) -> dict[str, int]:
    now = time.time() if now is None else now
    rng = np.random.default_rng(7)
    counts = {"txt2img": 0, "img2img": 0}
    recs = []
    for i in range(minutes):
        minute = (now - (minutes - i) * 60.0) // 60 * 60
        for app, med, sigma, n in (("txt2img", 0.4, 0.6, 40), ("img2img", 0.2, 0.1, 20)):
            ex = rng.lognormal(np.log(med), sigma, n)
            wait = rng.exponential(0.05, n)
            eh: dict[int, int] = {}
            lh: dict[int, int] = {}
            for e, w in zip(ex, wait, strict=True):
                ls.add(eh, float(e))
                ls.add(lh, float(e + w))
            slo = 1.5 if app == "txt2img" else 1.0
            recs.append({"app": app, "minute": minute, "n": n, "dropped": 1 if i % 5 == 0 else 0,
                         "met": int(np.sum(ex + wait <= slo)), "exec_sum": float(ex.sum()),
                         "exec_sumsq": float((ex * ex).sum()), "wait_sum": float(wait.sum()),
                         "latency_sum": float((ex + wait).sum()), "batch_sum": n, "exec_hist": ls.to_json(eh),
                         "latency_hist": ls.to_json(lh)})
            counts[app] += n
    with store.session() as s:
        upsert_workflow(s, WORKFLOW, labels={"kind": "serving"})
        set_slo(s, WORKFLOW, "txt2img", 1.5, target=0.9)
        set_slo(s, WORKFLOW, "img2img", 1.0, target=0.9)
        merge_minutes(s, WORKFLOW, recs, devices=4)
    return counts
