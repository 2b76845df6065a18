"""How long a move under way takes to give up, or to put its job back, when its source or target host falls silent,
driven through the real migration state machine on a fake clock (the move driven every second, as drive_actions
does; the agents played by tests.enforcer.silent_fleet, answering a checkpoint in 5 s unless said, a stop in 1 s, a
relaunch in 2 s; default limits: host_silence_s 120 s, checkpoint timeout 120 s, command grace 15 s).

Per case one JSON line: the move's final state, when it got there (seconds after the move was begun, and after the
silent host's last heartbeat), how long the job ran nowhere, the most copies of it that ran at once, where it runs,
the workflow's state, and the move's last message. Run it on a tree before and after a change to compare.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from store.db import Store  # noqa: E402
from store.migrations import upgrade  # noqa: E402
from tests.enforcer.silent_fleet import DST, SRC, T0, SilentFleet  # noqa: E402

CASES: list[tuple[str, dict[str, float | None], dict[str, float]]] = [
    # the source claims the checkpoint request 1 s in, falls silent 2 s in, and would have answered at 31 s
    ("source silent while its checkpoint is awaited", {SRC: T0 + 2, DST: None}, {"checkpoint": 30}),
    ("source silent before claiming the checkpoint", {SRC: T0 - 0.5, DST: None}, {}),
    # the target was last heard 110 s before the move was begun (allowed then); the checkpoint takes 15 s
    ("target silent before the stop", {SRC: None, DST: T0 - 110}, {"checkpoint": 15}),
    # the target was last heard 100 s before: the job is stopped at 9 s, the target counts as silent from 20 s
    ("target silent after the stop", {SRC: None, DST: T0 - 100}, {}),
    # the source answers the checkpoint, then falls silent with the stop pending / claimed
    ("source silent with the stop pending", {SRC: T0 + 7.5, DST: None}, {}),
    ("source silent with the stop claimed", {SRC: T0 + 8.5, DST: None}, {"stop": 30}),
    ("no host silent", {SRC: None, DST: None}, {}),
]


def case(name: str, silent_at: dict[str, float | None], takes: dict[str, float]) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="silent-moves-"))
    store = Store(f"sqlite:///{tmp / 'fleetlens.db'}")
    upgrade(store)
    try:
        f = SilentFleet(store, tmp, silent_at=silent_at)
        f.takes.update(takes)
        f.seed()
        f.begin()
        state, at = f.run(until=900)
        silent = min([t for t in silent_at.values() if t is not None] or [T0])
        return {"case": name, "state": state, "over_after_move_begun_s": at,
                "over_after_host_silent_s": round(at - (silent - T0), 1),
                "job_down_s": round(f.job_down_for(T0 + at), 1), "most_copies": f.most_copies, "job_on": f.running_on,
                "placement_on": f.placement_host(), "workflow_state": f.workflow_state(),
                "last_message": f.log().split(" | ")[-1]}
    finally:
        store.dispose()


def main() -> None:
    for name, silent_at, takes in CASES:
        print(json.dumps(case(name, silent_at, takes)), flush=True)


if __name__ == "__main__":
    main()
