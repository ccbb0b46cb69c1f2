"""``RUNLOG_REDACT_FIELDS`` wherever a secret can sit in what runlog prints: in JSON held
inside a string value, in a result runlog cut (no longer valid JSON), in evidence that is
not JSON. Printed by ``runlog show`` as a real process and by the console over HTTP."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import httpx
import pytest
import redis
from projections_support import env_for
from ui_support import TOKEN_A, console, projecting, wait_for
from workers.common import services_for

import runlog
from runlog._settings import Settings
from runlog.producers._bounds import CONTENT_BYTES, CUT_MARK

pytestmark = pytest.mark.timeout(180)

CARD = "4111 1111 " + "1111 1111"
"""Spelled in two halves so the test's own source never matches a search for it."""


def _nested(args: dict[str, Any], *, idempotency_key: str) -> str:
    # A gateway's answer: the card sits in JSON held inside a string value.
    return json.dumps({"status": 200, "body": json.dumps({"card": CARD, "amount": 7})})


def _large(args: dict[str, Any], *, idempotency_key: str) -> str:
    # Over the result budget: recorded cut, so what the log holds is no longer JSON.
    rows = [{"line": i, "text": "x" * 64} for i in range(CONTENT_BYTES // 64)]
    body = json.dumps({"card": CARD, "rows": rows})
    return json.dumps({"status": 200, "card": CARD, "body": body})


def _lost(args: dict[str, Any], *, idempotency_key: str) -> str:
    raise TimeoutError(f"gateway timed out; request was card={CARD}")


def _lookup(args: dict[str, Any], *, idempotency_key: str) -> runlog.Inconclusive:
    return runlog.Inconclusive(json.dumps({"echo": json.dumps({"card": CARD})}))


def _run(s: Settings) -> str:
    tools = [
        runlog.tool("charge", risk="safe")(_nested),
        runlog.tool("statement", risk="safe")(_large),
        runlog.tool("hold", risk="irreversible", reconcile=_lookup)(_lost),
    ]
    with runlog.open_run(tenant="acme", tools=tools, settings=s, goal="pay") as run:
        run.append("user_message", content="pay the invoice")
        run.call_tool("charge", {"request": json.dumps({"card": CARD})})
        cut = run.call_tool("statement", {"month": 11})
        assert CUT_MARK in cut and CARD in cut  # the log keeps what was written
        with pytest.raises(runlog.CallUncertain):
            run.call_tool("hold", {"amount": 7})
        return run.run_id


def _cli(s: Settings, *argv: str) -> str:
    """``runlog ARGV`` as a process of its own, with the redacted fields in its environment."""
    done = subprocess.run(
        [sys.executable, "-m", "runlog.cli", *argv],
        env=env_for(s, RUNLOG_REDACT_FIELDS="card"),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert CARD not in done.stdout and CARD.replace(" ", "") not in done.stdout
    return done.stdout


def test_show_never_prints_a_redacted_field_nested_or_cut(test_settings: Settings) -> None:
    s = test_settings.model_copy(update={"redact_fields": ("card",)})
    with services_for(s):
        rid = _run(s)
    for form in ([], ["--json"]):
        out = _cli(s, "show", rid, "--tenant", "acme", *form)
        assert "charge" in out and "statement" in out
        assert CUT_MARK in out and "[redacted]" in out
    story = json.loads(out)
    results = {c["tool"]: c["result"] for c in story["calls"] if c["result"] is not None}
    body = json.loads(json.loads(results["charge"])["body"])
    assert body == {"amount": 7, "card": "[redacted]"}  # the rest of the answer still shows
    state = json.loads(_cli(s, "replay", rid, "--tenant", "acme", "--state", "--json"))
    assert "[redacted]" in json.dumps(state["state"])


def test_the_console_and_the_projection_printers_never_show_a_redacted_field(
    test_settings: Settings, redis_client: redis.Redis
) -> None:
    s = test_settings.model_copy(update={"redact_fields": ("card",)})
    with services_for(s):
        rid = _run(s)
        with projecting(s, redis_client), console(s) as base:
            web = httpx.Client(
                base_url=base, timeout=30, headers={"Authorization": f"Bearer {TOKEN_A}"}
            )
            wait_for("the run in the index", lambda: rid in web.get("/").text)
            wait_for("the open call in the queue", lambda: "hold" in web.get("/uncertain").text)
            pages = [web.get(f"/runs/{rid}?all=1"), web.get("/uncertain")]
            wait_for("the audit trail", lambda: "hold" in _cli(s, "audit", rid, "--tenant", "acme"))
            # The projections' own printers read through the same redaction.
            for argv in (
                ["uncertain"],
                ["uncertain", "--json"],
                ["state", rid, "--tenant", "acme", "--json"],
            ):
                assert "[redacted]" in _cli(s, *argv)
            assert "[redacted]" in _cli(s, "audit", rid, "--tenant", "acme", "--json")
    for page in pages:
        assert page.status_code == 200
        assert CARD not in page.text and CARD.replace(" ", "") not in page.text
        assert "[redacted]" in page.text
    assert "statement" in pages[0].text and "cut" in pages[0].text
