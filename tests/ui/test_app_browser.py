"""The console in a real browser: Debian's Chromium, headless, driven by Selenium through
Debian's chromedriver (``.ci/run`` installs both).

1. A worker process waits on an approval; a person logs in, finds the run in the list,
   opens it, approves, and watches the page follow the worker to the end of its run.
2. A token for tenant A can neither see nor decide tenant B's run.

``RUNLOG_UI_SCREENSHOTS=docs/ui`` saves the pages the README shows.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from ui_support import TOKEN_A, TOKEN_ADMIN, console, projecting, wait_for
from workers.common import EXIT_OK, Ledger, services_for, start_worker

import runlog
from runlog._settings import Settings
from runlog.consumers._index import RunIndex
from runlog.consumers._timeline import run_timeline
from runlog.log._reader import LogReader
from runlog.schemas._keys import new_run_id

pytestmark = pytest.mark.timeout(240)

SHOTS = os.environ.get("RUNLOG_UI_SCREENSHOTS", "")


@pytest.fixture
def browser() -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    binary = shutil.which("chromium")
    driver = shutil.which("chromedriver")
    if binary is None or driver is None:
        pytest.fail(
            "the browser tests need Debian's chromium and chromium-driver "
            "(apt-get install -y chromium chromium-driver; .ci/run installs them)",
            pytrace=False,
        )
    opts = Options()
    opts.binary_location = binary
    for arg in (
        "--headless=new",
        "--no-sandbox",  # CI runs as root, where Chromium's sandbox cannot start
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1500,1000",
        "--hide-scrollbars",
    ):
        opts.add_argument(arg)
    # An explicit driver path: Selenium must not try to download one.
    web = webdriver.Chrome(service=Service(executable_path=driver), options=opts)
    web.set_page_load_timeout(30)
    try:
        yield web
    finally:
        web.quit()


def _shot(web: Any, name: str) -> None:
    if SHOTS:
        Path(SHOTS).mkdir(parents=True, exist_ok=True)
        height = web.execute_script("return document.body.scrollHeight")
        web.set_window_size(1500, max(700, min(int(height) + 200, 2600)))
        web.save_screenshot(str(Path(SHOTS) / name))
        web.set_window_size(1500, 1000)


def _login(web: Any, base: str, token: str) -> None:
    from selenium.webdriver.common.by import By

    web.get(f"{base}/login")
    web.find_element(By.ID, "token").send_keys(token)
    web.find_element(By.ID, "login").click()
    wait_for("the runs page", lambda: web.find_elements(By.ID, "runs"))


def _text(web: Any, css: str) -> str:
    """The first match's text, or "". The page refreshes itself: an element found just
    before a reload is gone when its text is read, so it is found again in the new page."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By

    for _ in range(50):
        found = web.find_elements(By.CSS_SELECTOR, css)
        if not found:
            return ""
        try:
            return str(found[0].text)
        except StaleElementReferenceException:
            time.sleep(0.05)
    raise AssertionError(f"{css} went stale 50 times in a row")


def test_browser_approves_a_waiting_worker_that_then_finishes(
    test_settings: Settings, redis_client: redis.Redis, tmp_path: Path, browser: Any
) -> None:
    from selenium.webdriver.common.by import By

    s = test_settings
    web = browser
    rid = new_run_id()
    worker = start_worker(
        s, tmp_path, "w1", "--run-id", rid, "--scenario", "approval", "--tenant", "acme"
    )
    with services_for(s), projecting(s, redis_client), console(s, refresh_s=1.0) as base:
        worker.wait_flag("waiting", timeout=60)
        _login(web, base, TOKEN_A)
        # The list refreshes itself: the run appears, waiting for a person.
        row = f'tr[data-run="{rid}"]'
        wait_for("the run in the list", lambda: "waiting" in _text(web, row), timeout=30)
        _shot(web, "runs.png")

        web.find_element(By.CSS_SELECTOR, f"{row} a").click()
        wait_for("the approval form", lambda: web.find_elements(By.CSS_SELECTOR, ".approval"))
        assert "refund 7 dollars to A-1" in _text(web, ".approval")
        assert _text(web, "#status") == "waiting"
        web.find_element(By.CSS_SELECTOR, ".approval input[name=note]").send_keys(
            "A-1 was billed twice"
        )
        _shot(web, "run-waiting.png")
        web.find_element(By.CSS_SELECTOR, ".approval button.approve").click()

        # The worker held the run, so the decision is queued for it; it records it, charges
        # and finishes, and the page (refreshing itself) follows it to the end.
        wait_for("the flash", lambda: "queued for the worker" in _text(web, ".flash"))
        wait_for("the run to finish", lambda: _text(web, "#status") == "finished", timeout=60)
        assert _text(web, "#outcome") == "succeeded"
        timeline = _text(web, "#timeline")
        assert "approved by ann: A-1 was billed twice" in timeline
        assert "charge completed" in timeline
        _shot(web, "run.png")

        code, result = worker.finish(timeout=60)
        assert code == EXIT_OK, result
        assert result["status"] == "finished"
        # The approved action ran exactly once.
        ledger = Ledger(redis_client, s.redis_key_prefix)
        assert ledger.total() == 1

        web.get(f"{base}/approvals")
        assert rid not in web.page_source
        web.get(f"{base}/lag")
        assert "state" in _text(web, "#lag")


def test_browser_token_of_tenant_a_cannot_see_or_decide_tenant_b(
    test_settings: Settings, redis_client: redis.Redis, browser: Any
) -> None:
    from selenium.webdriver.common.by import By

    s = test_settings
    web = browser
    runs: dict[str, tuple[str, str]] = {}
    with services_for(s):
        for tenant in ("acme", "globex"):
            with runlog.open_run(tenant=tenant, settings=s) as run:
                run.append("user_message", content=f"{tenant}: refund please")
                runs[tenant] = (run.run_id, run.request_approval(f"refund for {tenant}"))
        (mine, _), (theirs, their_ap) = runs["acme"], runs["globex"]
        with projecting(s, redis_client), console(s, refresh_s=1.0) as base:
            index = RunIndex(redis_client, s)
            wait_for("both runs indexed", lambda: index.find(mine) and index.find(theirs))
            _login(web, base, TOKEN_A)
            wait_for("A's run listed", lambda: mine in web.page_source)
            assert theirs not in web.page_source

            web.get(f"{base}/runs/{theirs}")
            refused = web.page_source.replace(theirs, "ID")
            assert _text(web, "#notfound") == f"No run {theirs} here."
            web.get(f"{base}/runs/r-no-such-run-000")
            assert web.page_source.replace("r-no-such-run-000", "ID") == refused

            web.get(f"{base}/approvals")
            assert mine in web.page_source and theirs not in web.page_source

            # Forge a decision with A's own session and CSRF value: still "not found".
            web.get(f"{base}/runs/{mine}")
            web.execute_script(
                """
                const f = document.createElement("form");
                f.method = "post";
                f.action = arguments[0];
                for (const [k, v] of Object.entries(arguments[1])) {
                  const i = document.createElement("input");
                  i.type = "hidden"; i.name = k; i.value = v; f.appendChild(i);
                }
                document.body.appendChild(f);
                f.submit();
                """,
                f"/runs/{theirs}/approvals/{their_ap}",
                {
                    "decision": "approve",
                    "note": "not mine to decide",
                    "csrf": web.find_element(By.NAME, "csrf").get_attribute("value"),
                },
            )
            wait_for("the refusal", lambda: web.find_elements(By.ID, "notfound"))
            assert web.page_source.replace(theirs, "ID") == refused

        with LogReader(s) as reader:
            tl = run_timeline(reader, redis_client, s, "globex", theirs)
        assert their_ap in tl.state.pending_approvals
        assert not [e for e in tl.entries if e["type"] == "approval_decided"]


def test_browser_question_of_an_uncertain_payment_then_a_confirmed_retry(
    test_settings: Settings, redis_client: redis.Redis, browser: Any
) -> None:
    """An irreversible payment timed out after its request was sent, and nothing can look
    it up: the person reads what may have happened and what approving does (it may pay
    twice), approves, must confirm that consequence restated, and only then is it recorded."""
    from selenium.webdriver.common.by import By

    s = test_settings
    web = browser
    invoked: list[str] = []

    def pay_fn(args: dict[str, Any], *, idempotency_key: str) -> str:
        invoked.append(idempotency_key)
        raise TimeoutError("read timed out after 5.0s (the request was sent)")

    pay = runlog.tool("pay", risk="irreversible")(pay_fn)
    with services_for(s):
        with runlog.open_run(tenant="acme", tools=[pay], settings=s) as run:
            with pytest.raises(runlog.Escalated):
                run.call_tool("pay", {"to": "A-1", "amount": 7})
            (ap,) = run.state.pending_approvals
            rid = run.run_id
        q = runlog.question(rid, ap, tenant="acme", settings=s)
        key = q.idempotency_key
        assert key is not None and q.started_at is not None
        with projecting(s, redis_client), console(s, refresh_s=0) as base:
            index = RunIndex(redis_client, s)
            wait_for("the run indexed", lambda: index.find(rid))
            _login(web, base, TOKEN_A)
            web.get(f"{base}/runs/{rid}")
            web.find_element(By.CSS_SELECTOR, f'.approval[data-approval="{ap}"] a.question').click()
            wait_for("the question", lambda: web.find_elements(By.ID, "question"))
            assert _text(web, "#q-tool") == "pay"
            assert _text(web, "#q-key") == key
            assert _text(web, "#q-args") == '{"amount":7,"to":"A-1"}'
            assert q.started_at in _text(web, "#q-started")
            assert "1 attempt" in _text(web, "#q-started")
            assert "read timed out after 5.0s" in _text(web, "#q-error")
            assert _text(web, "#q-dedupes") == "not declared"
            attempts = _text(web, "#attempts")
            assert "uncertain" in attempts and "read timed out" in attempts
            recon = _text(web, "#reconciliations")
            assert "no_reconciler" in recon and "escalate" in recon
            approve_means = _text(web, "#approve-means")
            assert f"retry pay with the same key {key}" in approve_means
            assert "NOT declared to deduplicate" in approve_means and "REPEATS" in approve_means
            assert "its effect stands" in _text(web, "#reject-means")
            # No inverse declared: "undo and retry" is not offered.
            assert not web.find_elements(By.ID, "undo-and-retry")
            assert not web.find_elements(By.ID, "undo-means")
            _shot(web, "question.png")

            web.find_element(By.CSS_SELECTOR, ".approval input[name=note]").send_keys(
                "bank says no charge arrived"
            )
            web.find_element(By.CSS_SELECTOR, ".approval button.approve").click()
            wait_for("the confirmation", lambda: web.find_elements(By.ID, "confirmation"))
            sentence = _text(web, "#confirmation")
            assert sentence == q.confirmation(True)
            assert f"Retry pay with key {key}" in sentence and "REPEATS" in sentence
            # Not recorded yet: the restated consequence has to be confirmed first.
            with LogReader(s) as reader:
                tl = run_timeline(reader, redis_client, s, "acme", rid)
            assert ap in tl.state.pending_approvals
            _shot(web, "confirm.png")

            web.find_element(By.ID, "confirm").click()
            wait_for("the flash", lambda: "Approved: recorded" in _text(web, ".flash"))
            assert "approved by ann: bank says no charge arrived" in _text(web, "#timeline")

        with LogReader(s) as reader:
            tl = run_timeline(reader, redis_client, s, "acme", rid)
        decided = [e for e in tl.entries if e["type"] == "approval_decided"]
        assert [(d["approval_id"], d["approved"], d["decided_by"]) for d in decided] == [
            (ap, True, "ann")
        ]
        # Recorded without the tools: the retry is the next owner's with them; nothing ran.
        assert invoked == [key]


def test_browser_undo_and_retry_of_a_conflicting_booking_then_one_booking_stands(
    fast: Settings, ledger: Ledger, redis_client: redis.Redis, browser: Any
) -> None:
    """A booking landed wrong and its inverse failed once: the question offers the third
    answer, "undo and retry", says what it does, and asks to confirm that restated; the
    decision is recorded as such, and the next owner with the tools undoes the wrong
    booking and books once under a fresh key."""
    producers_tests = str(Path(__file__).resolve().parents[1] / "producers")
    if producers_tests not in sys.path:  # their scenario helpers, when tests/ui runs alone
        sys.path.insert(0, producers_tests)
    import test_calls_compensation as wc
    import test_calls_undo_and_retry as ur
    from selenium.webdriver.common.by import By

    from runlog.schemas import _models as m

    web = browser
    svc, rid, esc = wc._escalated_booking(fast, ledger, "refuse-once")
    (key,) = set(svc.booked)
    ap = esc.approval_id
    assert ap is not None
    q = runlog.question(rid, ap, settings=fast)
    with projecting(fast, redis_client), console(fast, refresh_s=0) as base:
        index = RunIndex(redis_client, fast)
        wait_for("the run indexed", lambda: index.find(rid))
        _login(web, base, TOKEN_ADMIN)
        web.get(f"{base}/runs/{rid}/approvals/{ap}")
        wait_for("the question", lambda: web.find_elements(By.ID, "question"))
        undo_means = _text(web, "#undo-means")
        assert undo_means == q.undo_and_retry and "FRESH key" in undo_means
        web.find_element(By.CSS_SELECTOR, ".approval input[name=note]").send_keys("book 2 nights")
        web.find_element(By.ID, "undo-and-retry").click()
        wait_for("the confirmation", lambda: web.find_elements(By.ID, "confirmation"))
        sentence = _text(web, "#confirmation")
        assert sentence == q.undo_confirmation()
        assert f"Undo and retry book ({key})" in sentence and "inverse" in sentence
        assert "Confirm: undo_and_retry" in _text(web, "#confirm")
        with LogReader(fast) as reader:  # not recorded before it is confirmed
            tl = run_timeline(reader, redis_client, fast, "default", rid)
        assert ap in tl.state.pending_approvals
        web.find_element(By.ID, "confirm").click()
        wait_for("the flash", lambda: "Undo and retry: recorded" in _text(web, ".flash"))
        assert "chose undo and retry by root: book 2 nights" in _text(web, "#timeline")
    with LogReader(fast) as reader:
        tl = run_timeline(reader, redis_client, fast, "default", rid)
    decided = [e for e in tl.entries if e["type"] == "approval_decided"]
    assert [(d["approved"], d["answer"], d["decided_by"]) for d in decided] == [
        (True, m.UNDO_AND_RETRY, "root")
    ]
    assert ledger.per_key() == {key: 1}, "the console holds no tools: nothing ran yet"
    with runlog.open_run(rid, settings=fast, tools=svc.tools()):
        pass
    ur._one_booking_stands(fast, ledger, rid, key)
