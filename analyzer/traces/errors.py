"""Errors a trace file can cause: each names the file and says what is wrong with it."""

from __future__ import annotations

from store.errors import InvalidInput


class InvalidTrace(InvalidInput):
    """A trace file that cannot be analysed (missing, empty, truncated, not JSON, no events, too large)."""

    def __init__(self, path: str, problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"trace {self.path}: {problem}")
