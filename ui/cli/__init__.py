"""The `fleetlens` command line: every command module registers on one Typer app; errors print one line."""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import typer
from typer._click.exceptions import ClickException  # typer 0.29 carries its own click

from store.errors import FleetlensError
from ui.cli import agent as _agent  # noqa: F401  (registers agent)
from ui.cli import analyze as _analyze  # noqa: F401  (registers analyze)
from ui.cli import core  # noqa: F401  (registers init, status)
from ui.cli import dashboard as _dashboard  # noqa: F401  (registers ui, ui-passwd)
from ui.cli import demo as _demo  # noqa: F401  (registers demo)
from ui.cli import enforce as _enforce  # noqa: F401  (registers enforce, lanes)
from ui.cli import export as _export  # noqa: F401  (registers export, load-replay)
from ui.cli import findings as _findings  # noqa: F401  (registers findings, detect, rollup, rank)
from ui.cli import profile as _profile  # noqa: F401  (registers profile)
from ui.cli import prometheus as _prometheus  # noqa: F401  (registers import-prometheus, metrics-serve)
from ui.cli import run as _run  # noqa: F401  (registers run, move, drive)
from ui.cli import serve as _serve  # noqa: F401  (registers serve)
from ui.cli import serving as _serving  # noqa: F401  (registers serving slo, show, rightsize)
from ui.cli import simulate as _simulate  # noqa: F401  (registers simulate)
from ui.cli import slurm as _slurm  # noqa: F401  (registers slurm-import)
from ui.cli.app import app, err_console


class _Interrupts:
    """Whether Ctrl-C stopped the command. Typer turns the KeyboardInterrupt into a bare exit code 130, so the line
    that says so is printed from what this handler saw. Commands that handle SIGINT themselves (agent, serve, demo,
    ui) put their own handler in place while they run and say how they stopped."""

    def __init__(self) -> None:
        self.seen = False

    def handler(self, signum, frame) -> None:
        self.seen = True
        signal.default_int_handler(signum, frame)

    @contextmanager
    def watched(self) -> Iterator[None]:
        # only where Python's own handler is in place: a SIGINT ignored (a background job of a script) stays ignored
        if threading.current_thread() is not threading.main_thread() or \
                signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            yield
            return
        signal.signal(signal.SIGINT, self.handler)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)


def run(argv: list[str] | None = None) -> int:
    """Run one command and return its exit code; a user's error is one line on stderr and exit code 2."""
    interrupts = _Interrupts()
    try:
        with interrupts.watched():
            result = app(args=argv, standalone_mode=False)
    except FleetlensError as exc:
        err_console.print(f"fleetlens: {exc}", highlight=False, soft_wrap=True, markup=False)
        return exc.exit_code
    except typer.Exit as exc:
        return exc.exit_code
    except ClickException as exc:
        exc.show()
        return exc.exit_code
    except (typer.Abort, KeyboardInterrupt) as exc:
        # click turns a KeyboardInterrupt into Abort; ui.serve.processes.Stopped carries 143 for SIGTERM
        err_console.print("fleetlens: interrupted")
        return int(getattr(exc, "exit_code", None) or getattr(exc.__cause__, "exit_code", None) or 130)
    if interrupts.seen and result == 130:
        err_console.print("fleetlens: interrupted")
    return result if isinstance(result, int) else 0


def main() -> None:
    sys.exit(run())
