"""The `fleetlens` program's entry point: Ctrl-C while the command line still loads is a stop, not a traceback.

`ui.cli` loads every command module (SQLAlchemy, pandas, Typer, ...), which takes a few seconds on a cold machine; a
KeyboardInterrupt there would otherwise end in a traceback before `ui.cli.run` could say how the command stopped.
Nothing is written before the command runs, so there is nothing to undo: the program says it was interrupted and
exits 130, as a command interrupted later does. The import stands at the top, as every import of ours does; the
program's console script imports this module first, so the exit happens while it is imported.
"""

from __future__ import annotations

import signal
import sys

try:
    from ui.cli import run
except KeyboardInterrupt:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C while the line is written changes nothing
    sys.stderr.write("fleetlens: interrupted\n")
    sys.exit(130)


def main() -> None:
    sys.exit(run())
