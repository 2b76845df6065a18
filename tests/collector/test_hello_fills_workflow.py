"""A job's hello fills in what its workflow row lacks, whoever made the row first: the agent may record the job's
process (and so its workflow) before the hello is handled, and the name and declared steps must still arrive; what
the row already has is kept."""

from __future__ import annotations

from collector.sdk_workflows import touch_fields, touch_workflow
from store.models import Workflow
from store.workflows import upsert_workflow


def test_a_hello_after_the_row_exists_fills_its_name_and_steps_and_keeps_what_it_has(sqlite_store) -> None:
    with sqlite_store.session() as s:
        upsert_workflow(s, "seen-first")  # made from the process's samples, before the hello
        upsert_workflow(s, "named", name="set-by-fleetlens-run", declared_steps=50)
    hello = {"workflow": "seen-first", "name": "train-healthy", "total_steps": 300}
    with sqlite_store.session() as s:
        touch_workflow(s, touch_fields(hello))
        touch_workflow(s, touch_fields({**hello, "workflow": "named"}))
    with sqlite_store.session() as s:
        first, named = s.get(Workflow, "seen-first"), s.get(Workflow, "named")
        assert (first.name, first.declared_steps) == ("train-healthy", 300)
        assert (named.name, named.declared_steps) == ("set-by-fleetlens-run", 50)
