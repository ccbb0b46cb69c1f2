"""The console's "fork from here", in a real browser (Debian's Chromium, headless).

A person opens a finished run, forks it after its first charge, confirms what the fork will
do, and lands on the fork: its lineage, and what the other timeline did that the fork did
not inherit. The fork names the person as who forked, and why (its lineage record, and the
audit). A token of tenant A cannot fork tenant B's run: answered as an unknown run.
"""

from __future__ import annotations

from typing import Any

import pytest
import redis
from test_app_browser import _login, _shot, _text, browser  # noqa: F401 - the fixture
from ui_support import TOKEN_A, console, projecting, wait_for
from workers.common import read_log, services_for
from workers.fork_worker import charge_tool

import runlog
from runlog._settings import Settings
from runlog.consumers import _queries as queries
from runlog.consumers._index import RunIndex
from runlog.schemas._vocabulary import EventType

pytestmark = pytest.mark.timeout(240)


def test_browser_forks_a_run_from_a_timeline_event(
    test_settings: Settings,
    redis_client: redis.Redis,
    browser: Any,  # noqa: F811 - the fixture of test_app_browser
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    s = test_settings
    web = browser
    world = f"{s.redis_key_prefix}:world"
    tool = charge_tool(redis_client, world)
    with services_for(s):
        with runlog.open_run(tenant="acme", tools=[tool], settings=s) as run:
            run.call_tool("charge", {"n": 1})
            after_first = run.state.seq
            run.call_tool("charge", {"n": 2})
            run.finish("done")
            parent = run.run_id
        with runlog.open_run(tenant="globex", settings=s) as other:
            other.append("user_message", content="not yours")
            theirs = other.run_id
        with projecting(s, redis_client), console(s, refresh_s=0) as base:
            index = RunIndex(redis_client, s)
            wait_for("the runs indexed", lambda: index.find(parent) and index.find(theirs))
            _login(web, base, TOKEN_A)
            web.get(f"{base}/runs/{parent}")
            web.find_element(By.CSS_SELECTOR, f'button.fork[data-seq="{after_first}"]').click()
            wait_for("the confirmation", lambda: web.find_elements(By.ID, "fork-means"))
            assert f"after seq {after_first}" in _text(web, "#fork-means")
            Select(web.find_element(By.ID, "fork-effects")).select_by_value("inherit")
            web.find_element(By.ID, "fork-reason").send_keys("try a cheaper plan")
            _shot(web, "fork-confirm.png")
            web.find_element(By.ID, "confirm-fork").click()
            wait_for("the fork's link", lambda: web.find_elements(By.CSS_SELECTOR, "#forked a"))
            fork_id = _text(web, "#forked a")
            wait_for("the fork indexed", lambda: index.find(fork_id), timeout=30)
            web.get(f"{base}/runs/{parent}")  # the parent names its fork now
            assert fork_id in _text(web, "#forks")
            web.find_element(By.CSS_SELECTOR, "#forks a").click()
            wait_for("the lineage", lambda: web.find_elements(By.ID, "lineage"))
            lineage = _text(web, "#lineage")
            assert parent in lineage and f"at seq {after_first}" in lineage and "ann" in lineage
            assert "try a cheaper plan" in lineage
            other_timeline = _text(web, "#other-timeline")
            assert '{"n":2}' in other_timeline and parent in other_timeline
            _shot(web, "fork.png")

            # Audited: the fork's own log says who forked and why, and so does the audit.
            (first,) = [r.event for r in read_log(s, fork_id)]
            assert first.type is EventType.RUN_FORKED
            assert (first.payload.forked_by, first.payload.reason) == ("ann", "try a cheaper plan")  # type: ignore[attr-defined]
            wait_for(
                "the audit entry",
                lambda: any(
                    e["kind"] == "forked" and e["forked_by"] == "ann"
                    for e in queries.get_audit(redis_client, s, fork_id)
                ),
            )

            # Tenant A forging a fork of tenant B's run with its own session: "not found".
            web.get(f"{base}/runs/r-no-such-run-000")
            refused = web.page_source.replace("r-no-such-run-000", "ID")
            web.get(f"{base}/runs/{parent}")
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
                f"/runs/{theirs}/fork",
                {
                    "seq": "1",
                    "confirm": "yes",
                    "effects": "inherit",
                    "csrf": web.find_element(By.NAME, "csrf").get_attribute("value"),
                },
            )
            wait_for("the refusal", lambda: web.find_elements(By.ID, "notfound"))
            assert web.page_source.replace(theirs, "ID") == refused
    assert [r.event.type for r in read_log(s, theirs)] == [
        EventType.RUN_STARTED,
        EventType.USER_MESSAGE,
    ]
