"""The workflow row a job's hello makes or fills in: its name, id source, declared steps and sweep labels."""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from collector.sdk_memory import as_int
from store.models import Workflow
from store.rows import merge_labels
from store.workflows import upsert_workflow


def touch_fields(msg: dict[str, Any]) -> dict[str, Any]:
    total = as_int(msg.get("total_steps"))
    return {"workflow": msg["workflow"], "id_source": str(msg.get("id_source") or "env")[:16],
            "name": str(msg["name"])[:255] if msg.get("name") else None, "total_steps": total or None,
            "sweep": str(msg["sweep"])[:255] if msg.get("sweep") else None,
            "trial": str(msg["trial"])[:255] if msg.get("trial") else None}


def touch_workflow(session: Session, touch: dict[str, Any]) -> Workflow:
    wf = touch["workflow"]
    existing = session.get(Workflow, wf)
    if existing is not None:  # managed, known, or seen first by its process's samples: fill only what it lacks
        fields = {key: touch[value] for key, value in (("declared_steps", "total_steps"), ("name", "name"))
                  if getattr(existing, key) is None and touch[value]}
        workflow = upsert_workflow(session, wf, **fields)
    else:
        workflow = upsert_workflow(session, wf, id_source=touch["id_source"], name=touch["name"],
                                   declared_steps=touch["total_steps"])
    if touch.get("sweep"):  # a trial of a sweep (FLEETLENS_SWEEP): grouped with the sweep's other trials
        sweep = {"sweep": touch["sweep"], "trial": touch.get("trial") or wf}
        if any((workflow.labels or {}).get(k) != v for k, v in sweep.items()):
            merge_labels(session, workflow, sweep)
    return workflow
