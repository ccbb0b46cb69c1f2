"""``runlog ui``: serve the console with uvicorn."""

from __future__ import annotations

import ipaddress
import sys

import uvicorn

from runlog._settings import Settings
from runlog.ui._app import create_app
from runlog.ui._auth import UiSettings, parse_grants


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def serve(*, host: str = "127.0.0.1", port: int = 8642) -> int:
    """Run the console until SIGINT/SIGTERM; tokens are checked before it listens."""
    settings = Settings()
    ui = UiSettings()
    grants = parse_grants(ui.tokens)  # fail now, not at the first request
    if not _loopback(host):
        print(
            f"runlog ui: listening on {host}, not a loopback address: put TLS in front of it "
            "(tokens travel in every request)",
            file=sys.stderr,
        )
    print(f"runlog console on http://{host}:{port}/ ({len(grants)} token(s))", file=sys.stderr)
    app = create_app(settings, ui, grants=grants)
    # No access log: paths name runs, and a console is not a place to collect them.
    uvicorn.run(
        app, host=host, port=port, log_level="warning", access_log=False, server_header=False
    )
    return 0
