"""Cancel and Terminate in the console, in a real browser (Debian's Chromium, headless).

1. A worker process holds a run between two irreversible calls; a person opens the run,
   presses Cancel, reads what it does, gives a reason and confirms; the worker sees the
   request at its next step and the page follows the run to ``cancelled``.
2. A run nobody holds is terminated from its page the same way; its page then says
   ``terminated``. A token of another tenant gets "not found" for both pages and posts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from test_app_browser import _login, _shot, _text, browser  # noqa: F401 - the fixture
from ui_support import TOKEN_A, TOKEN_B, console, projecting, wait_for
from workers.common import Ledger, services_for, start_worker

import runlog
from runlog._settings import Settings

pytestmark = pytest.mark.timeout(240)

CONTROL = Path(__file__).resolve().parents[1] / "workers" / "control_worker.py"
EXIT_CANCELLED = 9


def _confirm(web: Any, link: str, reason: str) -> None:
    from selenium.webdriver.common.by import By

    wait_for(link, lambda: web.find_elements(By.ID, link))
    web.find_element(By.ID, link).click()
    wait_for("the confirmation page", lambda: web.find_elements(By.ID, "confirm-stop"))
    web.find_element(By.ID, "reason").send_keys(reason)


def test_browser_cancels_a_held_run_and_terminates_an_unowned_one(
    test_settings: Settings,
    redis_client: redis.Redis,
    tmp_path: Path,
    browser: Any,  # noqa: F811
) -> None:
    from selenium.webdriver.common.by import By

    s = test_settings
    web = browser
    held = "r-ui-cancel"
    worker = start_worker(
        s, tmp_path, "w", "--run-id", held, "--steps", "3", "--hold-at", "1", script=CONTROL
    )
    with services_for(s):
        with runlog.open_run("r-ui-term", tenant="acme", settings=s) as run:
            run.append("user_message", content="left behind")
        with projecting(s, redis_client), console(s, refresh_s=1.0) as base:
            worker.wait_flag("between", timeout=60)
            _login(web, base, TOKEN_A)
            web.get(f"{base}/runs/{held}")
            wait_for("the run page", lambda: _text(web, "#status") == "running", timeout=30)
            assert "owner" in _text(web, "#status-detail")

            _confirm(web, "cancel-run", "customer withdrew")
            what = _text(web, "#what")
            assert "recorded in its log" in what and "ann" in what and "cancelled" in what
            _shot(web, "cancel-confirm.png")
            web.find_element(By.ID, "confirm-stop").click()
            wait_for("the flash", lambda: "Cancel requested" in _text(web, ".flash"))
            worker.go()  # the owner's next step sees the request
            wait_for("cancelled", lambda: _text(web, "#status") == "cancelled", timeout=60)
            assert "ann" in _text(web, "#cancel-request")
            assert "customer withdrew" in _text(web, "#cancel-request")
            assert not web.find_elements(By.ID, "cancel-run")  # an ended run has no buttons
            code, result = worker.finish(timeout=60)
            assert code == EXIT_CANCELLED, result
            assert Ledger(redis_client, s.redis_key_prefix).total() == 1  # only step 0

            web.get(f"{base}/runs/r-ui-term")
            wait_for("orphaned", lambda: _text(web, "#status") == "orphaned", timeout=30)
            _confirm(web, "terminate-run", "stuck since the outage")
            assert "fenced" in _text(web, "#what") and "cannot be undone" in _text(web, "#what")
            web.find_element(By.ID, "confirm-stop").click()
            wait_for("terminated", lambda: _text(web, "#status") == "terminated", timeout=30)
            assert "Terminated" in _text(web, ".flash")
            timeline = _text(web, "#timeline")
            assert "terminated by ann: stuck since the outage" in timeline
            _shot(web, "terminated.png")

            # Another tenant's token: both pages and both posts are "not found".
            other = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {TOKEN_B}"})
            for rid in (held, "r-ui-term"):
                for action in ("cancel", "terminate"):
                    assert other.get(f"/runs/{rid}/stop/{action}").status_code == 404
                    posted = other.post(f"/runs/{rid}/stop/{action}", data={"reason": "mine"})
                    assert posted.status_code == 404
            # A reason is required, also when a client skips the form.
            mine = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {TOKEN_A}"})
            with runlog.open_run("r-ui-noreason", tenant="acme", settings=s) as run:
                run.append("user_message", content="x")
            wait_for(
                "indexed", lambda: mine.get("/runs/r-ui-noreason").status_code == 200, timeout=30
            )
            refused = mine.post("/runs/r-ui-noreason/stop/terminate", data={"reason": " "})
            assert refused.status_code == 400 and "reason is required" in refused.text
            assert "orphaned" in mine.get("/runs/r-ui-noreason").text
