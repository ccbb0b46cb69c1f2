"""The operator console over HTTP: a real uvicorn on 127.0.0.1, real projections, the real
decision path. Tokens, tenants, CSRF and what responses may carry."""

from __future__ import annotations

import re

import httpx
import pytest
import redis
from ui_support import GRANTS, TOKEN_A, TOKEN_ADMIN, console, projecting, wait_for
from workers.common import services_for

import runlog
from runlog._settings import Settings
from runlog.consumers._timeline import run_timeline
from runlog.log._reader import LogReader

pytestmark = pytest.mark.timeout(180)

SECRET = "pa55-" + "w0rd-7731"
MARKUP = "<script>steal(document.cookie)</script>"


def _waiting_run(s: Settings, tenant: str) -> tuple[str, str]:
    def login_fn(args: dict[str, object], *, idempotency_key: str) -> str:
        return '{"session": "s-1"}'

    login = runlog.tool("login", risk="safe")(login_fn)
    with runlog.open_run(tenant=tenant, tools=[login], settings=s, goal="refund") as run:
        run.append("user_message", content=f"{tenant} asks for a refund {MARKUP}")
        run.call_tool("login", {"user": "ann", "password": SECRET})
        approval = run.request_approval(f"refund 7 EUR for {tenant}")
        return run.run_id, approval


def _pending(s: Settings, client: redis.Redis, tenant: str, run_id: str) -> dict[str, object]:
    with LogReader(s) as reader:
        tl = run_timeline(reader, client, s, tenant, run_id)
    return dict(tl.state.pending_approvals)


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_console_tokens_tenants_csrf_and_decisions(
    test_settings: Settings, redis_client: redis.Redis
) -> None:
    s = test_settings.model_copy(update={"redact_fields": ("password",)})
    bodies: list[str] = []
    with services_for(s):
        acme, acme_ap = _waiting_run(s, "acme")
        globex, globex_ap = _waiting_run(s, "globex")
        with projecting(s, redis_client), console(s) as base:
            web = httpx.Client(base_url=base, follow_redirects=False, timeout=30)

            def get(path: str, token: str | None = None) -> httpx.Response:
                r = web.get(path, headers=_bearer(token) if token else {})
                bodies.append(r.text)
                return r

            # No token: a browser is sent to the login form; anything else is refused.
            r = get("/")
            assert r.status_code == 303 and r.headers["location"] == "/login"
            assert get("/", "not-a-token").status_code == 401
            assert web.post(f"/runs/{acme}/approvals/{acme_ap}").status_code == 401
            assert get("/login").status_code == 200
            # Every response carries the security headers, redirects included.
            assert "frame-ancestors 'none'" in r.headers["content-security-policy"]
            assert r.headers["x-content-type-options"] == "nosniff"

            wait_for(
                "both runs in the index",
                lambda: acme in get("/", TOKEN_ADMIN).text and globex in get("/", TOKEN_ADMIN).text,
            )
            # Tenant A's token sees its run, not B's; B's run is "not found", like no run.
            listed = get("/", TOKEN_A).text
            assert acme in listed and globex not in listed
            theirs = get(f"/runs/{globex}", TOKEN_A)
            nobody = get("/runs/r-no-such-run-000", TOKEN_A)
            assert theirs.status_code == nobody.status_code == 404
            assert theirs.text.replace(globex, "ID") == nobody.text.replace(
                "r-no-such-run-000", "ID"
            )
            assert globex not in get("/approvals", TOKEN_A).text
            assert globex in get("/approvals", TOKEN_ADMIN).text

            # Nor can A decide B's approval, even with a valid token and the right ids.
            r = web.post(
                f"/runs/{globex}/approvals/{globex_ap}",
                headers=_bearer(TOKEN_A),
                data={"decision": "approve", "note": "sneaky"},
            )
            assert r.status_code == 404
            assert r.text.replace(globex, "ID") == nobody.text.replace("r-no-such-run-000", "ID")
            assert globex_ap in _pending(s, redis_client, "globex", globex)

            # The run page: timeline, calls with secrets redacted, the approval form.
            page = get(f"/runs/{acme}", TOKEN_A)
            assert page.status_code == 200
            assert "refund 7 EUR for acme" in page.text and "[redacted]" in page.text
            assert SECRET not in page.text
            # What a run says is shown as text, never as markup of the console's page.
            assert MARKUP not in page.text and "&lt;script&gt;steal(" in page.text

            # Login form -> HttpOnly, SameSite=Strict cookie holding the session.
            r = web.post("/login", data={"token": "wrong-token-123"})
            assert r.status_code == 401 and "set-cookie" not in r.headers
            r = web.post("/login", data={"token": TOKEN_A})
            assert r.status_code == 303
            cookie = r.headers["set-cookie"].lower()
            assert "httponly" in cookie and "samesite=strict" in cookie
            page = web.get(f"/runs/{acme}")  # the client keeps the cookie now
            bodies.append(page.text)
            csrf = re.search(r'name="csrf" value="([0-9a-f]+)"', page.text)
            assert csrf is not None
            # A cookie alone cannot decide: no CSRF value, or a request from another site.
            url = f"/runs/{acme}/approvals/{acme_ap}"
            assert web.post(url, data={"decision": "approve"}).status_code == 403
            r = web.post(
                url,
                data={"decision": "approve", "csrf": csrf.group(1)},
                headers={"Origin": "https://evil.example"},
            )
            assert r.status_code == 403
            assert acme_ap in _pending(s, redis_client, "acme", acme)

            # The real thing: recorded through runlog.decide, under the token's name.
            r = web.post(
                url,
                data={"decision": "approve", "csrf": csrf.group(1), "note": "customer is right"},
            )
            assert r.status_code == 303
            assert r.headers["location"] == f"/runs/{acme}?done=approved-recorded"
            assert acme_ap not in _pending(s, redis_client, "acme", acme)
            with LogReader(s) as reader:
                tl = run_timeline(reader, redis_client, s, "acme", acme)
            decided = [e for e in tl.entries if e["type"] == "approval_decided"]
            assert [(d["decided_by"], d["note"], d["approved"]) for d in decided] == [
                ("ann", "customer is right", True)
            ]
            # Deciding it again is refused: a decision is final. The console's own page
            # names the decision that stands, and nothing more is recorded.
            r = web.post(url, data={"decision": "reject", "csrf": csrf.group(1)})
            assert r.status_code == 409
            assert (
                r.headers["content-type"].startswith("text/html") and 'href="/approvals"' in r.text
            )
            standing = r.text[r.text.index('id="standing"') :]
            assert "approved" in standing and "ann" in standing
            assert "customer is right" in standing and tl.decided[acme_ap]["at"] in standing
            with LogReader(s) as reader:
                again = run_timeline(reader, redis_client, s, "acme", acme)
            assert len([e for e in again.entries if e["type"] == "approval_decided"]) == 1

            for path in ("/uncertain", "/approvals", "/lag", f"/runs/{acme}"):
                r = get(path, TOKEN_A)
                assert r.status_code == 200, path
            frag = web.get("/", headers={"X-Fragment": "1"})
            assert frag.status_code == 200 and "<html" not in frag.text and acme in frag.text
            bodies.append(frag.text)

            r = web.post("/logout", data={"csrf": csrf.group(1)})
            assert r.status_code == 303
            web.cookies.clear()
            assert web.get("/").status_code == 303

    # Responses never carry a token or a redacted secret.
    for body in bodies:
        for token in GRANTS:
            assert token not in body
        assert SECRET not in body


def test_ui_command_binds_loopback_and_needs_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    from runlog.cli import build_parser
    from runlog.errors import ConfigError
    from runlog.ui._auth import UiSettings, parse_grants

    args = build_parser().parse_args(["ui"])
    assert args.host == "127.0.0.1"
    monkeypatch.delenv("RUNLOG_UI_TOKENS", raising=False)
    with pytest.raises(ConfigError, match="RUNLOG_UI_TOKENS"):
        parse_grants(UiSettings().tokens)
    monkeypatch.setenv("RUNLOG_UI_TOKENS", '{"tiny1": ["a"]}')
    with pytest.raises(ConfigError) as err:
        parse_grants(UiSettings().tokens)
    assert "tiny1" not in str(err.value)  # a token never appears in an error
    monkeypatch.setenv("RUNLOG_UI_TOKENS", '{"a-long-enough-token": ["a"]}')
    ui = UiSettings()
    assert "a-long-enough-token" not in repr(ui) and "a-long-enough-token" not in str(ui)


def test_a_long_run_page_shows_its_tail_unless_asked_for_all(
    test_settings: Settings, redis_client: redis.Redis
) -> None:
    s = test_settings
    with services_for(s):
        with runlog.open_run(tenant="acme", settings=s) as run:
            for i in range(520):
                run.emit("memory_written", key=f"k{i}", value="v")
            run.barrier()
            rid = run.run_id
        with projecting(s, redis_client), console(s) as base:
            web = httpx.Client(base_url=base, headers=_bearer(TOKEN_A), timeout=30)
            wait_for("the run indexed", lambda: web.get(f"/runs/{rid}").status_code == 200)
            tail = web.get(f"/runs/{rid}").text
            assert "21 earlier record(s) not shown" in tail  # 521 records, 500 shown
            assert "memory k519 written" in tail and "memory k0 written" not in tail
            whole = web.get(f"/runs/{rid}?all=1").text
            assert "not shown" not in whole and "memory k0 written" in whole
