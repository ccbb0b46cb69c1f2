"""The operator console: an ASGI app (Starlette), pages rendered on the server.

What it reads: the run index and the projections in Redis (lists, queue, audit, lag) and,
for one run's timeline, the log itself (``consumers._timeline``). What it writes: nothing
but decisions, through ``runlog.decide``, the path ``runlog approve`` takes.

Tenancy: a run whose tenant the token may not see gets the very response an unknown run
gets (404, same body), so the console never confirms that another tenant's run id exists.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlencode

import redis
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from runlog._api import cancel, decide, fork, reconcile, terminate
from runlog._settings import Settings
from runlog.consumers import _projection_metrics as projection_metrics
from runlog.consumers import _queries as queries
from runlog.consumers._index import STATUSES, RunIndex, RunRow, age_text, parse_since
from runlog.consumers._question import CALL_KINDS, question
from runlog.consumers._timeline import Timeline, run_timeline
from runlog.consumers.stores import PROJECTIONS
from runlog.errors import (
    DecisionConflict,
    Fenced,
    ForkRefused,
    InvalidRunId,
    KafkaUnavailable,
    NoLiveWorker,
    NotADecider,
    NotReconcilable,
    NotSettledYet,
    NotUndoable,
    RunFinished,
    RunlogError,
    UnknownApproval,
    UnknownRun,
)
from runlog.fleet._requests import Requested, requested
from runlog.log._clients import redis_client
from runlog.log._holders import status_now
from runlog.log._reader import LogReader
from runlog.producers._forks import EFFECTS_MODES
from runlog.schemas._keys import check_run_id
from runlog.schemas._models import UNDO_AND_RETRY
from runlog.ui._auth import ALL_TENANTS, COOKIE, Gate, Grant, UiSettings, parse_grants
from runlog.ui._pages import CONSOLE_JS, render

log = logging.getLogger(__name__)

PAGE_SIZE = 50
TIMELINE_TAIL = 500
"""Records a run page shows unless asked for all: a page of a 100,000-event run would be
too big to render, and to refresh every few seconds."""
MAX_NOTE = 2000
_HEADERS = {
    # Only our own script and styles inline in the page; no framing, no sniffing, no
    # referrer leaking run ids to other sites, nothing cached (pages show live state).
    # "same-origin", not "no-referrer": under no-referrer a browser sends ``Origin: null``
    # with our own form posts, and the same-origin check below would refuse them.
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
        "img-src 'self' data:; frame-ancestors 'none'; form-action 'self'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}
_FLASH = {
    "approved-recorded": "Approved: recorded in the run's log.",
    "approved-queued": "Approved: queued for the worker that holds the run.",
    "rejected-recorded": "Rejected: recorded in the run's log.",
    "rejected-queued": "Rejected: queued for the worker that holds the run.",
    "cancel-recorded": "Cancel requested: recorded in the run's log.",
    "cancel-queued": "Cancel requested: queued for the worker that holds the run.",
    "cancel-already": "An earlier cancel request stands.",
    "terminate-done": "Terminated: the run's owner is fenced and the run ended terminated.",
    "reconcile-completed": "Reconciled: the lookup found the effect; the call is completed "
    "(by evidence) in the run's log.",
    "reconcile-escalated": "Reconciled: the lookup's evidence goes to a person (see the question).",
    "reconcile-uncertain": "Reconciled: the lookup had no evidence either way; the call stays "
    "uncertain (recorded in the run's log).",
    "reconcile-retried": "Reconciled: the lookup proved the effect absent; the call was retried "
    "with its key.",
    "undo_and_retry-recorded": "Undo and retry: recorded in the run's log.",
    "undo_and_retry-queued": "Undo and retry: queued for the worker that holds the run.",
}


UI_RECONCILE_WAIT_S = 20.0
"""How long the Reconcile button waits for a worker's answer before saying it is queued."""
_REFUSED_WHY = {
    "not_open": "the call is no longer uncertain: the log has its outcome",
    "waits_for_person": "the call waits for a person's decision: answer its question",
    "no_lookup": "its tool declares no lookup (reconcile=) and is not irreversible: recovery "
    "would retry it, which checks nothing (and an ended run invokes nothing); undo or redo it at "
    "the receiver",
    "none": "the run has no uncertain call a lookup can settle",
    "no_agent": "the run was not started through the agent registry: no worker has its tools",
}


class SecurityHeaders:
    """Adds ``_HEADERS`` to every response, errors and redirects included."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers += [(k.lower().encode(), v.encode()) for k, v in _HEADERS.items()]
                message["headers"] = headers
            await send(message)

        await self.app(scope, receive, with_headers)


class Console:
    """The app's state: settings, grants, and clients created on first use."""

    def __init__(self, settings: Settings, ui: UiSettings, grants: dict[str, Grant]) -> None:
        self.settings = settings
        self.ui = ui
        self.gate = Gate(grants)
        self._redis: redis.Redis | None = None
        self._marks: projection_metrics.Watermarks | None = None

    @property
    def redis(self) -> redis.Redis:
        if self._redis is None:
            self._redis = redis_client(self.settings)
        return self._redis

    @property
    def marks(self) -> projection_metrics.Watermarks:
        if self._marks is None:
            self._marks = projection_metrics.Watermarks(self.settings)
        return self._marks

    def close(self) -> None:
        if self._marks is not None:
            self._marks.close()
        if self._redis is not None:
            self._redis.close()

    # Who is asking --------------------------------------------------------------------
    def who(self, request: Request) -> tuple[Grant | None, str, str]:
        """``(grant, token, how)``: how is ``bearer``, ``cookie`` or ``""`` (none given)."""
        header = request.headers.get("authorization", "")
        if header.lower().startswith("bearer "):
            token = header[7:].strip()
            return self.gate.grant(token), token, "bearer"
        token = request.cookies.get(COOKIE, "")
        if token:
            return self.gate.grant(token), token, "cookie"
        return None, "", ""

    def context(self, request: Request, grant: Grant, token: str) -> dict[str, Any]:
        label = "all" if ALL_TENANTS in grant.tenants else ", ".join(sorted(grant.tenants))
        return {
            "grant": grant,
            "csrf": self.gate.csrf(token),
            "tenants_label": label,
            "refresh_s": self.ui.refresh_s,
        }

    def page(
        self, request: Request, name: str, status_code: int = 200, **context: Any
    ) -> HTMLResponse:
        fragment = request.headers.get("x-fragment") == "1"
        return HTMLResponse(render(name, fragment, **context), status_code=status_code)

    # Reading --------------------------------------------------------------------------
    def visible_row(self, grant: Grant, run_id: str) -> RunRow | None:
        """The run's index row if this grant may see it; None for unknown *and* foreign."""
        try:
            check_run_id(run_id)
        except InvalidRunId:
            return None  # no run can have this id: answer as for any unknown run
        row = RunIndex(self.redis, self.settings).find(run_id)
        if row is None or not grant.allows(row.tenant):
            return None
        return row

    def requested(self, grant: Grant, tenant: str, run_id: str | None = None) -> list[Requested]:
        """Start requests this grant may see whose run has no row in the index (no log
        yet), read from the lifecycle topic: none when Kafka does not answer."""
        try:
            found = requested(
                self.settings,
                self.redis,
                tenants=[tenant] if tenant else None,
                run_ids=None if run_id is None else [run_id],
            )
        except KafkaUnavailable as exc:
            log.warning("start requests not read: %s", exc)
            return []
        index = RunIndex(self.redis, self.settings)
        return [r for r in found if grant.allows(r.tenant) and index.find(r.run_id) is None]

    def timeline(self, tenant: str, run_id: str) -> Timeline:
        with LogReader(self.settings) as reader:
            return run_timeline(reader, self.redis, self.settings, tenant, run_id)


Handler = Callable[[Request, Console, Grant, str], Awaitable[Response]]


def _same_origin(request: Request) -> bool:
    """A browser names the page a POST came from; refuse one from another site."""
    origin = request.headers.get("origin")
    if origin is None or origin == "null":
        return origin is None
    return origin == f"{request.url.scheme}://{request.url.netloc}"


def _not_found(request: Request, console: Console, ctx: dict[str, Any], run_id: str) -> Response:
    # One body for "no such run" and "not yours": nothing tells them apart.
    return console.page(request, "notfound.html", 404, message=f"No run {run_id} here.", **ctx)


def _local(path: str, fallback: str) -> str:
    """Only a path on this site may be a redirect target (no open redirect)."""
    if path.startswith("/") and not path.startswith("//") and "\\" not in path:
        return path
    return fallback


def create_app(
    settings: Settings, ui: UiSettings | None = None, *, grants: dict[str, Grant] | None = None
) -> Starlette:
    """The console for ``settings``' deployment; tokens from ``ui`` (default: environment)."""
    ui = ui or UiSettings()
    console = Console(settings, ui, grants if grants is not None else parse_grants(ui.tokens))

    def guarded(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            grant, token, how = console.who(request)
            if grant is None:
                if how == "bearer" or request.method != "GET":
                    return PlainTextResponse("a valid token is required", status_code=401)
                return RedirectResponse("/login", status_code=303)
            if request.method == "POST":
                if not _same_origin(request):
                    return PlainTextResponse("cross-site request refused", status_code=403)
                if how == "cookie":
                    form = await request.form()
                    csrf = form.get("csrf")
                    if not console.gate.csrf_ok(token, csrf if isinstance(csrf, str) else None):
                        return PlainTextResponse("missing or wrong CSRF token", status_code=403)
            try:
                return await handler(request, console, grant, token)
            except RunlogError as exc:
                # Name the kind of failure only: messages may carry addresses or internals.
                log.warning("console: %s on %s", type(exc).__name__, request.url.path)
                return PlainTextResponse(
                    f"the log or Redis is unavailable ({type(exc).__name__}); try again",
                    status_code=503,
                )

        return endpoint

    async def login_form(request: Request) -> Response:
        return console.page(request, "login.html", grant=None, refresh_s=0, error="")

    async def login(request: Request) -> Response:
        if not _same_origin(request):
            return PlainTextResponse("cross-site request refused", status_code=403)
        form = await request.form()
        token = form.get("token")
        token = token.strip() if isinstance(token, str) else ""
        if console.gate.grant(token) is None:
            return console.page(
                request, "login.html", 401, grant=None, refresh_s=0, error="Unknown token."
            )
        response = RedirectResponse("/", status_code=303)
        response.set_cookie(
            COOKIE,
            token,
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
            path="/",
        )
        return response

    async def logout(request: Request, c: Console, grant: Grant, token: str) -> Response:
        response = RedirectResponse("/login", status_code=303)
        response.delete_cookie(COOKIE, path="/")
        return response

    async def script(request: Request) -> Response:
        return Response(CONSOLE_JS, media_type="text/javascript")

    async def runs(request: Request, c: Console, grant: Grant, token: str) -> Response:
        q = request.query_params
        tenant, status, since_text = q.get("tenant", ""), q.get("status", ""), q.get("since", "")
        cursor = q.get("cursor") or None
        index = RunIndex(c.redis, c.settings)
        visible = grant.visible(await run_in_threadpool(index.tenants))
        wanted = [tenant] if tenant and grant.allows(tenant) else visible
        if tenant and not grant.allows(tenant):
            wanted = []
        since = None
        if since_text:
            with contextlib.suppress(RunlogError):  # an unreadable filter filters nothing
                since = parse_since(since_text)
        now = datetime.now(UTC)
        try:
            page = await run_in_threadpool(
                lambda: index.page(
                    tenants=wanted,
                    status=status if status in STATUSES else None,
                    since=since,
                    limit=PAGE_SIZE,
                    cursor=cursor,
                )
            )
        except ValueError:
            return PlainTextResponse("bad filter or cursor", status_code=400)
        counts = await run_in_threadpool(index.counts, wanted)
        asked: list[Requested] = []
        if cursor is None and not since_text and status in ("", "requested"):
            asked = await run_in_threadpool(c.requested, grant, tenant)
        next_url = None
        if page.next_cursor:
            params = {"tenant": tenant, "status": status, "since": since_text}
            params = {k: v for k, v in params.items() if v}
            next_url = "/?" + urlencode({**params, "cursor": page.next_cursor})
        ages = {r.run_id: age_text(r.age_s(now)) for r in page.rows}
        lasts = {
            r.run_id: age_text(
                (now - datetime.fromisoformat(r.last_event_at)).total_seconds()
                if r.last_event_at
                else None
            )
            for r in page.rows
        }
        return c.page(
            request,
            "runs.html",
            rows=[] if status == "requested" else page.rows,
            asked=asked,
            counts=counts,
            tenants=visible,
            tenant=tenant,
            statuses=(*STATUSES, "requested"),
            status=status,
            since=since_text,
            next_url=next_url,
            ages=ages,
            lasts=lasts,
            **c.context(request, grant, token),
        )

    async def run_page(request: Request, c: Console, grant: Grant, token: str) -> Response:
        run_id = request.path_params["run_id"]
        ctx = c.context(request, grant, token)
        row = await run_in_threadpool(c.visible_row, grant, run_id)
        if row is None:
            if _run_id_or_none(run_id) is not None:
                asked = await run_in_threadpool(c.requested, grant, "", run_id)
                if asked:
                    return c.page(request, "requested.html", req=asked[0], **ctx)
            return _not_found(request, c, ctx, run_id)
        try:
            tl = await run_in_threadpool(c.timeline, row.tenant, run_id)
        except UnknownRun:
            return _not_found(request, c, ctx, run_id)
        everything = request.query_params.get("all") == "1"
        entries_shown = tl.entries if everything else tl.entries[-TIMELINE_TAIL:]
        entries = await run_in_threadpool(queries.get_audit, c.redis, c.settings, run_id)
        audit = [_audit_row(e) for e in entries]
        forks = await run_in_threadpool(RunIndex(c.redis, c.settings).children, row.tenant, run_id)
        pending = [
            {
                "approval_id": a.approval_id,
                "kind": a.kind,
                "reason": a.reason,
                "requested_at": a.requested_at.isoformat(timespec="seconds"),
                "idempotency_key": a.idempotency_key,
                "about_a_call": a.kind in CALL_KINDS,
                "due": _due_text(a.due_at, datetime.now(UTC)),
            }
            for a in tl.state.pending_approvals.values()
        ]
        told = await run_in_threadpool(status_now, c.redis, c.settings, tl.state)
        left_open = (
            sorted(tl.state.open_calls.values(), key=lambda x: x.started_seq) if told.ended else []
        )
        return c.page(
            request,
            "run.html",
            run_id=run_id,
            tl=tl,
            entries=entries_shown,
            hidden=len(tl.entries) - len(entries_shown),
            st=tl.state,
            status=told.status,
            told=told,
            left_open=left_open,
            pending=pending,
            audit=audit,
            next=f"/runs/{run_id}",
            flash=_FLASH.get(request.query_params.get("done", ""), ""),
            forked=_run_id_or_none(request.query_params.get("forked")),
            forks=forks,
            **ctx,
        )

    async def approvals(request: Request, c: Console, grant: Grant, token: str) -> Response:
        index = RunIndex(c.redis, c.settings)
        visible = grant.visible(await run_in_threadpool(index.tenants))
        now = datetime.now(UTC)

        def waiting() -> list[dict[str, Any]]:
            out: list[dict[str, Any]] = []
            for status in ("waiting", "cancelling"):
                for row in index.page(tenants=visible, status=status, limit=200).rows:
                    view = queries.get_state(c.redis, c.settings, row.run_id)
                    if view is None:
                        continue
                    for a in view["state"]["approvals"].values():
                        if a["approved"] is not None:
                            continue
                        asked = datetime.fromisoformat(a["requested_at"])
                        due = a.get("due_at")
                        out.append(
                            {
                                "tenant": row.tenant,
                                "run_id": row.run_id,
                                "approval_id": a["approval_id"],
                                "kind": a["kind"],
                                "about_a_call": a["kind"] in CALL_KINDS,
                                "reason": a["reason"],
                                "age": age_text((now - asked).total_seconds()),
                                "asked": asked,
                                "due": _due_text(
                                    None if due is None else datetime.fromisoformat(due), now
                                ),
                            }
                        )
            out.sort(key=lambda a: a["asked"])
            return out

        return c.page(
            request,
            "approvals.html",
            approvals=await run_in_threadpool(waiting),
            next="/approvals",
            flash=_FLASH.get(request.query_params.get("done", ""), ""),
            **c.context(request, grant, token),
        )

    async def uncertain(request: Request, c: Console, grant: Grant, token: str) -> Response:
        rep = await run_in_threadpool(queries.uncertain_report, c.redis, c.settings)
        calls = []
        oldest: dict[str, float] = {}
        for call in rep.open:
            if not grant.allows(call["tenant"]):
                continue
            oldest[call["risk"]] = max(oldest.get(call["risk"], 0.0), call["age_s"])
            calls.append(
                {
                    **call,
                    "age": age_text(call["age_s"]),
                    "deadline": age_text(call["deadline_s"]),
                }
            )
        return c.page(
            request,
            "uncertain.html",
            calls=calls,
            overdue=[x for x in calls if x["overdue"]],
            oldest={k: age_text(v) for k, v in sorted(oldest.items())},
            **c.context(request, grant, token),
        )

    async def lag(request: Request, c: Console, grant: Grant, token: str) -> Response:
        snap = await run_in_threadpool(
            projection_metrics.collect, c.redis, c.settings, PROJECTIONS, c.marks.high
        )
        return c.page(request, "lag.html", snap=snap, **c.context(request, grant, token))

    async def question_view(request: Request, c: Console, grant: Grant, token: str) -> Response:
        """What an approval asks: what may have happened and what each answer does."""
        run_id = request.path_params["run_id"]
        approval_id = request.path_params["approval_id"]
        # Not refreshed while read: the question must not change under the reader's eyes
        # (a decision made elsewhere meanwhile is refused, and named, when this one is sent).
        ctx = {**c.context(request, grant, token), "refresh_s": 0}
        row = await run_in_threadpool(c.visible_row, grant, run_id)
        if row is None:
            return _not_found(request, c, ctx, run_id)
        try:
            tl = await run_in_threadpool(c.timeline, row.tenant, run_id)
            q = question(tl, approval_id)
        except UnknownRun:
            return _not_found(request, c, ctx, run_id)
        except UnknownApproval:
            message = f"Run {run_id} never asked {approval_id}."
            return c.page(request, "notfound.html", 404, message=message, **ctx)
        return c.page(
            request,
            "question.html",
            run_id=run_id,
            q=q,
            a={"approval_id": approval_id},
            next=f"/runs/{run_id}",
            **ctx,
        )

    async def decide_view(request: Request, c: Console, grant: Grant, token: str) -> Response:
        run_id = request.path_params["run_id"]
        approval_id = request.path_params["approval_id"]
        ctx = c.context(request, grant, token)
        row = await run_in_threadpool(c.visible_row, grant, run_id)
        if row is None:
            return _not_found(request, c, ctx, run_id)
        form = await request.form()
        choice = form.get("decision")
        if choice not in ("approve", "reject", "undo_and_retry"):
            return PlainTextResponse(
                "decision must be approve, reject or undo_and_retry", status_code=400
            )
        note_raw = form.get("note")
        note = note_raw[:MAX_NOTE] if isinstance(note_raw, str) else ""
        try:
            tl = await run_in_threadpool(c.timeline, row.tenant, run_id)
        except UnknownRun:
            return _not_found(request, c, ctx, run_id)
        approved, undo = choice != "reject", choice == "undo_and_retry"

        def refused(standing: DecisionConflict) -> Response:
            return c.page(
                request,
                "decided.html",
                409,
                run_id=run_id,
                approval_id=approval_id,
                standing=standing,
                standing_verb=_verb(standing),
                yours=choice.replace("_", " "),
                **ctx,
            )

        def cannot_undo(why: str) -> Response:
            return c.page(
                request,
                "not_undoable.html",
                409,
                run_id=run_id,
                approval_id=approval_id,
                why=why,
                **ctx,
            )

        standing = tl.decision_conflict(approval_id)
        if standing is not None:
            return refused(standing)
        if approval_id not in tl.state.pending_approvals:
            return PlainTextResponse(
                f"{approval_id} is not waiting for a decision in this run", status_code=409
            )
        q = question(tl, approval_id)
        if undo and not q.undoable:
            return cannot_undo(
                f"{q.tool} declared no inverse (compensate=), so nothing can be undone"
                if q.about_a_call
                else "it is not about a call"
            )
        if q.about_a_call and form.get("confirm") != "yes":
            # Nobody answers "try again?" about an effect that may have happened: the
            # consequence is restated, and only its confirmation records the decision.
            return c.page(
                request,
                "confirm.html",
                run_id=run_id,
                q=q,
                decision=choice,
                sentence=q.undo_confirmation() if undo else q.confirmation(approved),
                note=note,
                next=nxt if isinstance(nxt := form.get("next"), str) and nxt else f"/runs/{run_id}",
                **{**ctx, "refresh_s": 0},
            )
        try:
            how = await run_in_threadpool(
                lambda: decide(
                    run_id,
                    approval_id,
                    approved=approved,
                    decided_by=grant.name,
                    note=note,
                    tenant=row.tenant,
                    settings=c.settings,
                    undo_and_retry=undo,
                )
            )
        except DecisionConflict as exc:
            return refused(exc)
        except NotUndoable as exc:
            return cannot_undo(str(exc))
        except NotADecider as exc:
            # The console's settings hold no trusted decider key: nothing was recorded.
            return PlainTextResponse(f"not recorded: {exc}", status_code=403)
        log.info("console: %s %s %s of %s (%s)", grant.name, choice, approval_id, run_id, how)
        nxt_raw = form.get("next")
        target = _local(nxt_raw if isinstance(nxt_raw, str) else "", f"/runs/{run_id}")
        verb = "undo_and_retry" if undo else "approved" if approved else "rejected"
        sep = "&" if "?" in target else "?"
        return RedirectResponse(f"{target}{sep}done={verb}-{how}", status_code=303)

    async def stop_view(request: Request, c: Console, grant: Grant, token: str) -> Response:
        """Cancel or terminate a run: a page that restates what it does and asks why (GET),
        then the act itself with the reason and the token's name (POST)."""
        run_id, action = request.path_params["run_id"], request.path_params["action"]
        if action not in ("cancel", "terminate"):
            return PlainTextResponse("action must be cancel or terminate", status_code=404)
        ctx = {**c.context(request, grant, token), "refresh_s": 0}
        row = await run_in_threadpool(c.visible_row, grant, run_id)
        if row is None:
            return _not_found(request, c, ctx, run_id)
        try:
            tl = await run_in_threadpool(c.timeline, row.tenant, run_id)
        except UnknownRun:
            return _not_found(request, c, ctx, run_id)
        told = await run_in_threadpool(status_now, c.redis, c.settings, tl.state)

        def confirm(code: int = 200, reason: str = "", error: str = "") -> Response:
            return c.page(
                request,
                "stop.html",
                code,
                run_id=run_id,
                action=action,
                verb=action.capitalize(),
                status=told.status,
                open_calls=len(tl.state.open_calls),
                reason=reason,
                error=error,
                **ctx,
            )

        if request.method == "GET":
            return confirm()
        form = await request.form()
        raw = form.get("reason")
        reason = raw.strip()[:MAX_NOTE] if isinstance(raw, str) else ""
        if not reason:
            return confirm(400, error="A reason is required: it is recorded with your name.")
        if told.ended:
            return confirm(409, reason, f"The run has already ended ({told.status}).")

        def act() -> str:
            if action == "cancel":
                how = cancel(
                    run_id, reason=reason, by=grant.name, tenant=row.tenant, settings=c.settings
                )
                return f"cancel-{how}"
            terminate(run_id, reason=reason, by=grant.name, tenant=row.tenant, settings=c.settings)
            return "terminate-done"

        try:
            done = await run_in_threadpool(act)
        except (RunFinished, Fenced) as exc:
            return confirm(409, reason, f"Not recorded: the run ended meanwhile ({exc}).")
        log.info("console: %s %s %s: %s (%s)", grant.name, action, run_id, reason, done)
        return RedirectResponse(f"/runs/{run_id}?done={done}", status_code=303)

    async def reconcile_view(request: Request, c: Console, grant: Grant, token: str) -> Response:
        """The Reconcile button of an uncertain call (the uncertain page, a run's open calls):
        the fleet runs the tool's lookup (``runlog.reconcile``) and the run's page says what
        the log then holds; a refusal (no lookup, no live worker, not answered in time, no
        longer uncertain) is a page that says so, never a "done"."""
        run_id = request.path_params["run_id"]
        ctx = {**c.context(request, grant, token), "refresh_s": 0}
        row = await run_in_threadpool(c.visible_row, grant, run_id)
        if row is None:
            return _not_found(request, c, ctx, run_id)
        form = await request.form()
        raw = form.get("key")
        key = raw if isinstance(raw, str) and raw else None

        def refused(code: int, why: str, approval: str | None = None) -> Response:
            return c.page(
                request,
                "reconcile.html",
                code,
                run_id=run_id,
                key=key,
                why=why,
                approval=approval,
                **ctx,
            )

        try:
            done = await run_in_threadpool(
                lambda: reconcile(
                    run_id,
                    key,
                    by=grant.name,
                    tenant=row.tenant,
                    settings=c.settings,
                    wait_s=UI_RECONCILE_WAIT_S,
                )
            )
        except UnknownRun:
            return _not_found(request, c, ctx, run_id)
        except NotReconcilable as exc:
            approval = None
            if exc.why in ("no_lookup", "waits_for_person") and key is not None:
                tl = await run_in_threadpool(c.timeline, row.tenant, run_id)
                call = tl.state.open_calls.get(key)
                approval = call.approval_id if call is not None else None
            return refused(409, _REFUSED_WHY.get(exc.why, "it is not an uncertain call"), approval)
        except NoLiveWorker as exc:
            return refused(
                503,
                f"no live worker serves the run's agent {exc.agent!r}: nothing "
                "was asked; start one (runlog worker) and try again",
            )
        except NotSettledYet as exc:
            return refused(
                202,
                f"no worker answered within {UI_RECONCILE_WAIT_S:g} s (the run's "
                f"owner may hold it); request {exc.request_id} stays queued",
            )
        outcomes = {x.outcome for x in done.settled}
        how = outcomes.pop() if len(outcomes) == 1 else "uncertain"
        log.info("console: %s reconciled %s %s: %s", grant.name, run_id, key or "*", how)
        return RedirectResponse(f"/runs/{run_id}?done=reconcile-{how}", status_code=303)

    async def fork_view(request: Request, c: Console, grant: Grant, token: str) -> Response:
        """ "fork from here" on a timeline event: restated, confirmed, then recorded (the
        fork's lineage names the console user as who forked, and why)."""
        run_id = request.path_params["run_id"]
        ctx = c.context(request, grant, token)
        row = await run_in_threadpool(c.visible_row, grant, run_id)
        if row is None:
            return _not_found(request, c, ctx, run_id)
        form = await request.form()
        raw_seq = form.get("seq")
        if not isinstance(raw_seq, str) or not raw_seq.isdigit():
            return PlainTextResponse("seq must be a number", status_code=400)
        seq = int(raw_seq)
        if form.get("confirm") != "yes":
            return c.page(request, "fork.html", run_id=run_id, seq=seq, **{**ctx, "refresh_s": 0})
        effects = form.get("effects")
        if effects not in EFFECTS_MODES:
            return PlainTextResponse("effects must be inherit, ask or execute", status_code=400)
        reason_raw = form.get("reason")
        reason = reason_raw[:MAX_NOTE] if isinstance(reason_raw, str) else ""
        try:
            made = await run_in_threadpool(
                lambda: fork(
                    run_id,
                    at_seq=seq,
                    tenant=row.tenant,
                    effects=str(effects),
                    forked_by=grant.name,
                    reason=reason,
                    settings=c.settings,
                )
            )
        except UnknownRun:
            return _not_found(request, c, ctx, run_id)
        except ForkRefused:
            return PlainTextResponse(f"cannot fork {run_id} at seq {seq}", status_code=409)
        log.info("console: %s forked %s at seq %s into %s", grant.name, run_id, seq, made.run_id)
        return RedirectResponse(f"/runs/{run_id}?forked={made.run_id}", status_code=303)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            console.close()

    app = Starlette(
        routes=[
            Route("/login", login_form, methods=["GET"]),
            Route("/login", login, methods=["POST"]),
            Route("/logout", guarded(logout), methods=["POST"]),
            Route("/static/console.js", script, methods=["GET"]),
            Route("/", guarded(runs), methods=["GET"]),
            Route("/runs/{run_id}", guarded(run_page), methods=["GET"]),
            Route(
                "/runs/{run_id}/approvals/{approval_id}", guarded(question_view), methods=["GET"]
            ),
            Route("/runs/{run_id}/approvals/{approval_id}", guarded(decide_view), methods=["POST"]),
            Route("/runs/{run_id}/stop/{action}", guarded(stop_view), methods=["GET", "POST"]),
            Route("/runs/{run_id}/fork", guarded(fork_view), methods=["POST"]),
            Route("/runs/{run_id}/reconcile", guarded(reconcile_view), methods=["POST"]),
            Route("/approvals", guarded(approvals), methods=["GET"]),
            Route("/uncertain", guarded(uncertain), methods=["GET"]),
            Route("/lag", guarded(lag), methods=["GET"]),
        ],
        lifespan=lifespan,
    )
    app.add_middleware(SecurityHeaders)
    return app


def _run_id_or_none(value: str | None) -> str | None:
    if not value:
        return None
    try:
        return check_run_id(value)
    except InvalidRunId:
        return None


def _audit_row(entry: dict[str, Any]) -> dict[str, Any]:
    skip = {"kind", "at", "seq", "epoch", "partition", "offset", "writer"}
    detail = []
    for k, v in sorted(entry.items()):
        if k in skip or v in (None, ""):
            continue
        detail.append(f"{k}={v}")
    return {
        "at": entry.get("at", ""),
        "seq": entry.get("seq", ""),
        "kind": entry["kind"],
        "detail": " ".join(detail),
    }


def _verb(standing: DecisionConflict) -> str:
    """The standing decision's answer, as the console names it."""
    if standing.approved and standing.answer == UNDO_AND_RETRY:
        return "undo and retry"
    return "approved" if standing.approved else "rejected"


def _due_text(due: datetime | None, now: datetime) -> str:
    """When a request's decision is due, for people: ``-``, ``in 17m``, ``OVERDUE 5h``."""
    if due is None:
        return "-"
    left = (due - now).total_seconds()
    return f"in {age_text(left)}" if left > 0 else f"OVERDUE {age_text(-left)}"
