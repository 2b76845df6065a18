"""`fleetlens ui` runs the Streamlit dashboard on the configured store; `fleetlens ui-passwd` makes a hash."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import typer

from store.errors import ConfigError
from ui.cli.app import app, console, err_console, settings
from ui.dashboard.auth import hash_password
from ui.serve.processes import Stopped, run_foreground, stop_on_signals

APP = Path(__file__).resolve().parents[1] / "dashboard" / "app.py"


def streamlit_command(port: int, address: str | None = None) -> list[str]:
    command = [
        sys.executable, "-m", "streamlit", "run", str(APP),
        "--server.port", str(port),
        "--server.headless", "true",
        "--browser.gatherUsageStats", "false",
        "--server.fileWatcherType", "none",
        "--client.toolbarMode", "viewer",
    ]
    if address:
        command += ["--server.address", address]
    return command


@app.command()
def ui(
    port: int = typer.Option(None, help="port to serve on (default FLEETLENS_UI_PORT, 8501)"),
    address: str = typer.Option(None, help="address to bind (default: all interfaces)"),
) -> None:
    """Start the dashboard (Streamlit, headless) on the configured store."""
    s = settings()
    port = port or s.ui_port
    if not 0 < port < 65536:
        raise ConfigError(f"--port {port} is not a TCP port; use 1..65535")
    env = dict(os.environ)
    # The dashboard process reads the same store this command resolved (FLEETLENS_HOME or FLEETLENS_DB_URL).
    env["FLEETLENS_DB_URL"] = s.resolved_db_url
    env["FLEETLENS_HOME"] = str(s.home)
    console.print(f"fleetlens dashboard on http://localhost:{port} (store {s.resolved_db_url.split('@')[-1]})")
    sys.stdout.flush()
    with stop_on_signals():  # SIGINT/SIGTERM stop the dashboard and exit 130/143, even if SIGINT came in ignored
        try:
            code = run_foreground(streamlit_command(port, address), env)
        except Stopped as stop:
            code = stop.exit_code
    raise typer.Exit(code)


@app.command("ui-passwd")
def ui_passwd(
    name: str = typer.Argument(..., help="the operator's name, as they will type it to sign in"),
    password_stdin: bool = typer.Option(False, "--password-stdin", help="read the password from stdin"),
) -> None:
    """Make an operator entry for FLEETLENS_UI_OPERATORS (PBKDF2-SHA256 hash of a password)."""
    if not name or any(c in name for c in ":,"):
        raise ConfigError(f"operator name {name!r} must be non-empty and contain no ':' or ','")
    if password_stdin:
        password = sys.stdin.readline().rstrip("\n")
    else:
        password = typer.prompt("Password", hide_input=True, confirmation_prompt=True)
    entry = f"{name}:{hash_password(password)}"
    console.print(entry, highlight=False, soft_wrap=True)
    err_console.print(
        "add it to FLEETLENS_UI_OPERATORS (comma-separated entries), e.g. "
        f"export FLEETLENS_UI_OPERATORS='{entry}'",
        style="dim", highlight=False, soft_wrap=True, markup=False,
    )
