"""The console on a real uvicorn (127.0.0.1, a free port) and live projection services,
shared by tests/ui/test_app.py (HTTP) and tests/ui/test_app_browser.py (Chromium)."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import redis
import uvicorn
from pydantic import SecretStr

from runlog._settings import Settings
from runlog.consumers.runner import ProjectionRunner
from runlog.consumers.stores import PROJECTIONS
from runlog.ui._app import create_app
from runlog.ui._auth import UiSettings

TOKEN_A = "tok-acme-" + uuid.uuid4().hex
TOKEN_B = "tok-globex-" + uuid.uuid4().hex
TOKEN_ADMIN = "tok-admin-" + uuid.uuid4().hex
GRANTS = {
    TOKEN_A: {"tenants": ["acme"], "name": "ann"},
    TOKEN_B: ["globex"],
    TOKEN_ADMIN: {"tenants": ["*"], "name": "root"},
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def console(settings: Settings, refresh_s: float = 1.0) -> Iterator[str]:
    """The console app served by uvicorn in a thread; yields its base URL."""
    ui = UiSettings(tokens=SecretStr(json.dumps(GRANTS)), refresh_s=refresh_s)
    app = create_app(settings, ui)
    port = _free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
    )
    thread = threading.Thread(target=server.run, name="console", daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "console did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)


@contextlib.contextmanager
def projecting(settings: Settings, client: redis.Redis) -> Iterator[ProjectionRunner]:
    """``runlog project all`` in a thread, as a deployment runs it beside the console."""
    runner = ProjectionRunner(settings, client, PROJECTIONS, group=f"ui-{uuid.uuid4().hex[:8]}")
    thread = threading.Thread(target=runner.run, name="projections", daemon=True)
    thread.start()
    try:
        yield runner
    finally:
        runner.stop()
        thread.join(timeout=30)


def wait_for(what: str, check: Callable[[], Any], timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)
