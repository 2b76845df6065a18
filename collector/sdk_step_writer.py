"""Writing the job SDK's queued step summaries and workflow memory figures: all in one transaction, and when the
database refuses that (a value out of its column's range, a string too long, a row it will not take for another reason
than being away) the batch split, so that one bad row never takes the others with it.

The split goes one workflow at a time: its workflow row, then its step rows (halved until each refused row stands
alone), then its memory figures, each part in its own transaction. What the database refuses alone is given up and
returned as a `Refusal`; an outage (DatabaseUnavailable, raised through) leaves whatever is not in `done_rows` and
`done_memory` for the caller to keep for the next try: nothing written is written twice, nothing unwritten is lost.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from collector.sdk_memory import record_workflow_memory
from collector.sdk_workflows import touch_workflow
from store.db import Store
from store.errors import DatabaseUnavailable
from store.models import StepStat

log = logging.getLogger(__name__)

MemoryFigures = tuple[int | None, int | None, str | None, int]
MAX_LOGGED_REFUSALS = 4096  # (workflow, what, kind) of the refusals already logged once


@dataclass
class RefusedCounts:
    """What the database refused of the job SDK's rows (a value out of its column's range, say; not for being away),
    each given up alone, the rows written with it kept. The agent's stats (collector.agent_batch.AgentStats) hold
    these counters."""

    sdk_rows_refused: int = 0  # step summaries
    sdk_memory_refused: int = 0  # workflows' memory figures
    # the oldest step summaries dropped while the database was away, past the queue's cap (MAX_QUEUED_STEP_ROWS)
    sdk_rows_over_cap: int = 0


@dataclass(frozen=True)
class Refusal:
    """What the database would not take of one workflow, and why."""

    workflow: str
    what: str  # "step summaries" | "memory figures"
    count: int
    kind: str  # the error's class name, e.g. DataError, IntegrityError
    reason: str  # the database's own message, first line


def refusal(workflow: str, what: str, count: int, exc: BaseException) -> Refusal:
    cause = getattr(exc, "orig", None) or exc
    text = str(cause).strip().splitlines()
    return Refusal(workflow, what, count, type(cause).__name__, text[0] if text else type(cause).__name__)


class RefusalLog:
    """Counts what the database refused (rows that would block every later write if kept) in `stats`, and says so
    once per workflow, what and kind of refusal (later ones at debug level)."""

    def __init__(self, stats: RefusedCounts) -> None:
        self.stats = stats
        self._logged: set[tuple[str, str, str]] = set()

    def note(self, r: Refusal) -> None:
        if r.what == "step summaries":
            self.stats.sdk_rows_refused += r.count
        else:
            self.stats.sdk_memory_refused += r.count
        key = (r.workflow, r.what, r.kind)
        if key in self._logged:
            log.debug("job SDK: %d %s of workflow %.200r refused again (%s: %s)", r.count, r.what, r.workflow, r.kind,
                      r.reason)
            return
        if len(self._logged) >= MAX_LOGGED_REFUSALS:
            self._logged.pop()
        self._logged.add(key)
        log.error("job SDK: the database refused %d %s of workflow %.200r, given up (%s: %s); the other rows are "
                  "written; later refusals of this kind for this workflow are counted in the agent's stats, not logged",
                  r.count, r.what, r.workflow, r.kind, r.reason)


class StepWriter:
    """One write of what the SDK handlers took off their queues."""

    def __init__(self, store: Store, host_id: str, rows: list[dict[str, Any]], memory: Mapping[str, MemoryFigures],
                 contexts: Mapping[str, int | None]) -> None:
        self.store, self.host_id = store, host_id
        self.rows, self.memory, self.contexts = rows, memory, contexts
        # the workflow row must exist before its step rows: the first row of each message carries what makes it
        self.touches = {r["workflow_id"]: r["_touch"] for r in rows if "_touch" in r}
        self.done_rows: set[int] = set()  # indexes into `rows` written or given up
        self.done_memory: set[str] = set()  # workflows whose memory figures were written or given up
        self._refused: dict[tuple[str, str, str], Refusal] = {}

    @property
    def refusals(self) -> list[Refusal]:
        """What was given up so far (also when the database went away in the middle of the split)."""
        return list(self._refused.values())

    def write(self) -> None:
        """Write everything; what the database would not take is in `refusals`. Raises DatabaseUnavailable when the
        database is away (`done_rows`, `done_memory` say what was settled before, `refusals` what was given up)."""
        try:
            self._transaction(self.touches.values(), range(len(self.rows)), sorted(self.memory))
        except DatabaseUnavailable:
            raise
        except Exception:  # refused, not away: find what the database will not take
            self._split()

    def _transaction(self, touches: Any, indexes: Any, memory: list[str]) -> None:
        indexes = list(indexes)
        with self.store.session() as session:
            for touch in touches:
                touch_workflow(session, touch)
            session.add_all(StepStat(**{k: v for k, v in self.rows[i].items() if k != "_touch"}) for i in indexes)
            for wf in memory:  # rows locked in one order by every agent
                record_workflow_memory(session, wf, self.host_id, self.memory[wf], self.contexts.get(wf))
        self.done_rows.update(indexes)
        self.done_memory.update(memory)

    def _split(self) -> None:
        by_workflow: dict[str, list[int]] = {}
        for i, row in enumerate(self.rows):
            by_workflow.setdefault(row["workflow_id"], []).append(i)
        for wf in sorted(by_workflow.keys() | self.memory.keys()):
            self._write_workflow(wf, by_workflow.get(wf, []))

    def _give_up(self, workflow: str, what: str, count: int, exc: BaseException) -> None:
        """Note what the database refused alone, one Refusal per workflow, what and kind (their rows summed)."""
        r = refusal(workflow, what, count, exc)
        key = (r.workflow, r.what, r.kind)
        self._refused[key] = replace(r, count=self._refused[key].count + count) if key in self._refused else r

    def _write_workflow(self, wf: str, indexes: list[int]) -> None:
        touch = [self.touches[wf]] if wf in self.touches else []
        memory = [wf] if wf in self.memory else []
        try:
            self._transaction(touch, indexes, memory)
            return
        except DatabaseUnavailable:
            raise
        except Exception:
            pass
        if touch:
            try:
                self._transaction(touch, [], [])
            except DatabaseUnavailable:
                raise
            except Exception as exc:  # its workflow row cannot be made: none of its rows can be written
                self.done_rows.update(indexes)
                self.done_memory.update(memory)
                if indexes:
                    self._give_up(wf, "step summaries", len(indexes), exc)
                if memory:
                    self._give_up(wf, "memory figures", 1, exc)
                return
        self._halves(wf, touch, indexes)
        if memory:
            try:
                self._transaction(touch, [], memory)
            except DatabaseUnavailable:
                raise
            except Exception as exc:
                self.done_memory.add(wf)
                self._give_up(wf, "memory figures", 1, exc)

    def _halves(self, wf: str, touch: list[dict[str, Any]], indexes: list[int]) -> None:
        """Write `indexes` (known to hold a refused row when more than one) half by half, down to single rows."""
        if not indexes:
            return
        if len(indexes) == 1:
            try:
                self._transaction(touch, indexes, [])
            except DatabaseUnavailable:
                raise
            except Exception as exc:
                self.done_rows.update(indexes)
                self._give_up(wf, "step summaries", 1, exc)
            return
        for half in (indexes[:len(indexes) // 2], indexes[len(indexes) // 2:]):
            if len(half) > 1:
                try:
                    self._transaction(touch, half, [])
                    continue
                except DatabaseUnavailable:
                    raise
                except Exception:
                    pass
            self._halves(wf, touch, half)
