"""Compensation, the fourth answer to the window keys cannot close: a reversible tool's
declared inverse, run by recovery when an unwanted effect is found, recorded as a call of
its own (started, completed, failed, uncertain) and shown in the audit and uncertain-call
projections. The receiver is a real ledger in Redis whose inverse can fail."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import redis
from workers.common import Ledger, shape, valid_events, worker_env

import runlog
from runlog._settings import Settings
from runlog.log._clients import redis_client as make_redis
from runlog.projections import _audit as audit
from runlog.projections import _uncertain as uncertain
from runlog.schemas import _models as m
from runlog.schemas._canonical import canonical_json
from runlog.schemas._vocabulary import EventType

pytestmark = pytest.mark.timeout(60)

ARGS = {"room": "R-7", "nights": 2}


class Booking:
    """A booking service. Its first request books the wrong number of nights and the
    answer is lost; its inverse (cancel) fails as told: ``"ok"``, ``"refuse-once"`` (a
    proven failure, then it works) or ``"timeout"`` (the cancel's answer is lost)."""

    def __init__(self, ledger: Ledger, inverse: str = "ok") -> None:
        self.ledger, self.inverse = ledger, inverse
        self.booked: list[str] = []
        self.cancels: list[tuple[str, str]] = []

    def book(self, args: dict[str, Any], *, idempotency_key: str) -> str:
        self.booked.append(idempotency_key)
        if len(self.booked) == 1:
            self.ledger.apply(idempotency_key, canonical_json({**args, "nights": 20}))
            raise TimeoutError("booking service timed out after accepting")
        self.ledger.apply(idempotency_key, canonical_json(args))
        return f"booked {args['room']}"

    def lookup(self, args: dict[str, Any], *, idempotency_key: str) -> Any:
        found = self.ledger.found(idempotency_key)
        if found is None:
            return runlog.Absent("no booking")
        if found != canonical_json(args):
            return runlog.Conflict(found)
        return runlog.Match(f"booked {args['room']}")

    def cancel(self, args: dict[str, Any], *, idempotency_key: str, original_key: str) -> str:
        self.cancels.append((idempotency_key, original_key))
        if self.inverse == "refuse-once" and len(self.cancels) == 1:
            raise runlog.ToolError("cancellation refused: try later")
        r = self.ledger.redis
        r.hincrby(self.ledger.counts, original_key, -1)
        r.hdel(self.ledger.args, original_key)
        if self.inverse == "timeout":
            raise TimeoutError("cancel timed out")
        return f"cancelled {original_key}"

    def tools(self) -> list[Any]:
        book = runlog.tool("book", risk="reversible", reconcile=self.lookup, compensate=self.cancel)
        room_service = runlog.tool("room_service", risk="reversible")(
            lambda args, *, idempotency_key: "served"
        )
        return [book(self.book), room_service]


_STEPS = {
    EventType.TOOL_CALL_STARTED: ("started", "name", "attempt"),
    EventType.TOOL_CALL_COMPLETED: ("completed", "name", "is_error"),
    EventType.TOOL_CALL_UNCERTAIN: ("uncertain", "name"),
    EventType.RECONCILIATION_ATTEMPTED: ("reconciliation", "outcome", "action"),
    EventType.APPROVAL_REQUESTED: ("approval_requested", "kind", "name"),
}


def _shape(events: list[m.Event]) -> list[tuple[Any, ...]]:
    return shape(events, _STEPS, leave_out={EventType.RUN_STARTED})


def _audit(events: list[m.Event]) -> list[dict[str, Any]]:
    run = audit.AuditRun()
    return [e for i, ev in enumerate(events) for e in audit.apply_event(run, ev, 0, i)]


def test_a_conflicting_effect_is_compensated_then_the_call_retried(
    fast: Settings, ledger: Ledger
) -> None:
    svc = Booking(ledger)
    with runlog.open_run(settings=fast, tools=svc.tools()) as run:
        assert run.call_tool("book", ARGS) == "booked R-7"
        rid = run.run_id
    (key,) = set(svc.booked)
    assert ledger.per_key() == {key: 1} and ledger.found(key) == canonical_json(ARGS)
    (cancel_key, undone), *_ = svc.cancels
    assert undone == key and cancel_key != key and len(svc.cancels) == 1
    events = valid_events(fast, rid)
    assert _shape(events) == [
        ("started", "book", 1),
        ("uncertain", "book"),
        ("reconciliation", "conflict", "retry_compensate"),
        ("started", "book/compensate", 1),
        ("completed", "book/compensate", False),
        ("started", "book", 2),
        ("completed", "book", False),
    ]
    comp = next(
        p
        for ev in events
        if isinstance(p := ev.payload, m.ToolCallStarted) and p.name == "book/compensate"
    )
    assert comp.operation_id == key and comp.idempotency_key == cancel_key
    entries = [e for e in _audit(events) if e["kind"].startswith("compensation")]
    assert [(e["kind"], e["compensates"]) for e in entries] == [
        ("compensation_started", key),
        ("compensation_completed", key),
    ]


def _escalated_booking(
    fast: Settings, ledger: Ledger, inverse: str
) -> tuple[Booking, str, runlog.Escalated]:
    """A booking whose inverse does not settle the conflict: the run stops for a person.

    Returns the service, the run id and the escalation the call raised."""
    svc = Booking(ledger, inverse=inverse)
    with runlog.open_run(settings=fast, tools=svc.tools()) as run:
        with pytest.raises(runlog.Escalated) as esc:
            run.call_tool("book", ARGS)
        assert run.state.status == "escalated"
        with pytest.raises(runlog.Escalated):  # a conflict stops every other effect
            run.call_tool("room_service", {"room": "R-7"})
    return svc, run.run_id, esc.value


def test_an_inverse_that_fails_stops_the_run_until_a_person_decides(
    fast: Settings, ledger: Ledger
) -> None:
    svc, rid, esc = _escalated_booking(fast, ledger, "refuse-once")
    (key,) = set(svc.booked)
    assert ledger.per_key() == {key: 1} and len(svc.cancels) == 1
    events = valid_events(fast, rid)
    assert _shape(events)[2:] == [
        ("reconciliation", "conflict", "retry_compensate"),
        ("started", "book/compensate", 1),
        ("completed", "book/compensate", True),
        ("reconciliation", "conflict", "escalate"),
        ("approval_requested", "conflict", "book"),
    ]
    # A person rules the wrong booking must not stand: the inverse runs again and works.
    assert esc.approval_id is not None
    got = runlog.decide(
        rid,
        esc.approval_id,
        approved=False,
        decided_by="ops",
        note="guest cancelled",
        tools=svc.tools(),
        settings=fast,
    )
    assert got == "recorded"
    assert ledger.per_key() == {key: 0} and len(svc.cancels) == 2
    assert svc.cancels[0][0] == svc.cancels[1][0], "a failed inverse retries with its key"
    events = valid_events(fast, rid)
    done = [
        p for ev in events if isinstance(p := ev.payload, m.ToolCallCompleted) and p.name == "book"
    ]
    assert len(done) == 1 and "guest cancelled" in done[0].content
    assert "compensated by" in done[0].content and len(svc.booked) == 1
    kinds = [e["kind"] for e in _audit(events) if e["kind"].startswith("compensation")]
    assert kinds == [
        "compensation_started",
        "compensation_failed",
        "compensation_started",
        "compensation_completed",
    ]


def test_an_inverse_whose_outcome_is_lost_is_an_uncertain_call_of_its_own(
    fast: Settings, ledger: Ledger
) -> None:
    svc, rid, _ = _escalated_booking(fast, ledger, "timeout")
    (key,) = set(svc.booked)
    events = valid_events(fast, rid)
    queue = uncertain.UncertainRun()
    for ev in events:
        uncertain.apply_event(queue, ev)
    by_tool = {c.tool: c for c in queue.calls.values()}
    assert set(by_tool) == {"book", "book/compensate"}
    assert by_tool["book/compensate"].compensates == key
    assert by_tool["book/compensate"].status == "escalated"  # a person settles a lost inverse
    assert by_tool["book"].status == "conflict"
    assert len(svc.cancels) == 1


def _inverses(events: list[m.Event]) -> list[tuple[str, str | None]]:
    """Each compensation call in the log: (its key, the key it undoes), by its STARTED."""
    return [
        (p.idempotency_key, p.operation_id)
        for ev in events
        if isinstance(p := ev.payload, m.ToolCallStarted) and p.name == "book/compensate"
    ]


def _reject_with_the_cli(fast: Settings, rid: str, approval_id: str) -> None:
    reject = ["reject", rid, approval_id, "--by", "ops", "--note", "guest cancelled"]
    done = subprocess.run(
        [sys.executable, "-m", "runlog.cli", *reject],
        env=worker_env(fast),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "recorded" in done.stdout


def _reject_in_the_console(fast: Settings, rid: str, approval_id: str) -> None:
    from ui_support import TOKEN_ADMIN, console, projecting, wait_for

    client = make_redis(fast)
    try:
        with projecting(fast, client), console(fast) as base:
            web = httpx.Client(base_url=base, follow_redirects=False, timeout=30)
            assert web.post("/login", data={"token": TOKEN_ADMIN}).status_code == 303

            def form() -> str | None:
                page = web.get(f"/runs/{rid}")  # found once the index lists the run
                return page.text if page.status_code == 200 and approval_id in page.text else None

            csrf = re.search(r'name="csrf" value="([0-9a-f]+)"', wait_for("the form", form))
            assert csrf is not None
            url = f"/runs/{rid}/approvals/{approval_id}"
            data = {"decision": "reject", "csrf": csrf.group(1), "note": "guest cancelled"}
            # A decision on a call is recorded only once its restated consequence (here:
            # the inverse runs first) is confirmed.
            r = web.post(url, data=data)
            assert r.status_code == 200 and 'id="confirmation"' in r.text and "inverse" in r.text
            r = web.post(url, data={**data, "confirm": "yes"})
            assert r.status_code == 303 and "rejected-recorded" in r.headers["location"]
    finally:
        client.close()


@pytest.mark.parametrize("where", [_reject_with_the_cli, _reject_in_the_console])
def test_a_rejection_recorded_without_the_tools_leaves_the_compensation_owed(
    fast: Settings, ledger: Ledger, where: Callable[[Settings, str, str], None]
) -> None:
    """``runlog reject`` and the console hold no tools: they record the decision, and the
    owner that next opens the run with its tools undoes the wrong booking before anything
    else acts, as a call of its own, and only then closes the call."""
    svc, rid, esc = _escalated_booking(fast, ledger, "refuse-once")
    (key,) = set(svc.booked)
    assert esc.approval_id is not None
    where(fast, rid, esc.approval_id)
    # Nothing could be undone without the tools: the call stays open, decided.
    assert ledger.per_key() == {key: 1} and len(svc.cancels) == 1
    before = valid_events(fast, rid)
    assert not [
        p for ev in before if isinstance(p := ev.payload, m.ToolCallCompleted) and p.name == "book"
    ]

    with runlog.open_run(rid, settings=fast, tools=svc.tools()) as run:
        # Recovery ran inside open_run, before the caller could act.
        assert key not in run.state.open_calls and run.state.status == "running"
        assert "compensated by" in run.state.completed_calls[key]
    assert ledger.per_key() == {key: 0} and len(svc.cancels) == 2
    events = valid_events(fast, rid, after_seq=before[-1].seq)
    assert _shape(events)[1:] == [
        ("reconciliation", "decided", "resolve"),
        ("started", "book/compensate", 1),
        ("completed", "book/compensate", False),
        ("completed", "book", False),
    ]
    (inverse, undone), *_ = _inverses(events)
    assert undone == key and inverse == svc.cancels[1][0] == svc.cancels[0][0]
    closed = next(
        p for ev in events if isinstance(p := ev.payload, m.ToolCallCompleted) and p.name == "book"
    )
    assert closed.content.endswith(f"(compensated by {inverse})")
    assert "guest cancelled" in closed.content and len(svc.booked) == 1

    # Settled once: opening the run again undoes nothing more.
    with runlog.open_run(rid, settings=fast, tools=svc.tools()):
        pass
    assert ledger.per_key() == {key: 0} and len(svc.cancels) == 2


class Rebooking:
    """A booking service that deduplicates nothing and counts the bookings that stand:
    its first two requests book 20 nights instead of 2 and lose their answer; its cancel
    takes back one standing booking of the original key."""

    def __init__(self, client: redis.Redis, prefix: str) -> None:
        self.redis, self.live = client, f"{prefix}:rebooking:live"
        self.requests = 0
        self.cancels: list[tuple[str, str]] = []

    def standing(self) -> list[str]:
        return [b.decode() for b in self.redis.lrange(self.live, 0, -1)]

    def book(self, args: dict[str, Any], *, idempotency_key: str) -> str:
        self.requests += 1
        wrong = self.requests <= 2
        made = {**args, "nights": 20} if wrong else args
        self.redis.rpush(self.live, json.dumps([idempotency_key, canonical_json(made)]))
        if wrong:
            raise TimeoutError("booking service timed out after accepting")
        return f"booked {args['room']}"

    def lookup(self, args: dict[str, Any], *, idempotency_key: str) -> Any:
        mine = [made for k, made in map(json.loads, self.standing()) if k == idempotency_key]
        if not mine:
            return runlog.Absent("no booking")
        wrong = [made for made in mine if made != canonical_json(args)]
        return runlog.Conflict(wrong[0]) if wrong else runlog.Match(f"booked {args['room']}")

    def cancel(self, args: dict[str, Any], *, idempotency_key: str, original_key: str) -> str:
        self.cancels.append((idempotency_key, original_key))
        for entry in self.standing():
            if json.loads(entry)[0] == original_key:
                self.redis.lrem(self.live, 1, entry)
                return f"cancelled one booking of {original_key}"
        raise runlog.ToolError(f"no booking of {original_key} to cancel")

    def tools(self) -> list[Any]:
        book = runlog.tool("book", risk="reversible", reconcile=self.lookup, compensate=self.cancel)
        return [book(self.book)]


def test_each_wrong_effect_gets_an_inverse_of_its_own(
    fast: Settings, redis_client: redis.Redis
) -> None:
    """Conflict, inverse, the retry books wrong again, a person rejects: the second wrong
    booking is undone by a second inverse with its own key, and "compensated" names it."""
    svc = Rebooking(redis_client, fast.redis_key_prefix)
    with runlog.open_run(settings=fast, tools=svc.tools()) as run:
        with pytest.raises(runlog.Escalated) as esc:
            run.call_tool("book", ARGS)
        rid = run.run_id
    assert svc.requests == 2 and len(svc.standing()) == 1 and len(svc.cancels) == 1
    assert esc.value.approval_id is not None
    got = runlog.decide(
        rid,
        esc.value.approval_id,
        approved=False,
        decided_by="ops",
        note="guest cancelled",
        tools=svc.tools(),
        settings=fast,
    )
    assert got == "recorded"
    assert svc.standing() == [], "a wrong booking still stands"
    events = valid_events(fast, rid)
    inverses = _inverses(events)
    (key,) = {undone for _, undone in inverses}
    assert len(inverses) == 2 and len({k for k, _ in inverses}) == 2
    assert [k for k, _ in svc.cancels] == [k for k, _ in inverses]
    completed = {
        p.idempotency_key
        for ev in events
        if isinstance(p := ev.payload, m.ToolCallCompleted)
        and p.name == "book/compensate"
        and not p.is_error
    }
    assert completed == {k for k, _ in inverses}
    closed = next(
        p
        for ev in events
        if isinstance(p := ev.payload, m.ToolCallCompleted) and p.idempotency_key == key
    )
    assert closed.content.endswith(f"(compensated by {inverses[1][0]})")


def test_compensate_is_for_reversible_tools_and_its_name_is_reserved() -> None:
    with pytest.raises(ValueError, match="reversible"):
        runlog.tool("pay", risk="irreversible", compensate=lambda *a, **k: "")
    with pytest.raises(ValueError, match="compensate"):
        runlog.tool("pay/compensate")(lambda args, *, idempotency_key: "")


@pytest.mark.parametrize("first", ["inverse", "original"])
def test_rejecting_a_lost_inverse_is_no_evidence_that_anything_was_undone(
    fast: Settings, ledger: Ledger, first: str
) -> None:
    """The inverse's answer is lost, so it is escalated as a call of its own; a person
    rejects that escalation (it must not run again). That closes the inverse's key, and is
    no evidence that it undid anything: a rejection of the original, before or after,
    never records "compensated by" it; the original is left to a person, still open."""
    svc, rid, esc = _escalated_booking(fast, ledger, "timeout")
    (key,) = set(svc.booked)
    assert esc.approval_id is not None
    with runlog.open_run(rid, settings=fast, tools=svc.tools()) as run:
        (inverse,) = [k for k, c in run.state.open_calls.items() if c.name == "book/compensate"]
        (inverse_ap,) = [
            a.approval_id for a in run.state.approvals.values() if a.idempotency_key == inverse
        ]
    order = [inverse_ap, esc.approval_id]
    if first == "original":
        order.reverse()
    for approval_id in order:
        with runlog.open_run(rid, settings=fast, tools=svc.tools()) as run:
            pending = run.state.pending_approvals
            target = approval_id
            if target not in pending:  # the original was asked again, under a new request
                (target,) = [a for a, ap in pending.items() if ap.idempotency_key == key]
        runlog.decide(
            rid,
            target,
            approved=False,
            decided_by="ops",
            note="no",
            tools=svc.tools(),
            settings=fast,
        )
    events = valid_events(fast, rid)
    closed = [
        p for ev in events if isinstance(p := ev.payload, m.ToolCallCompleted) and p.name == "book"
    ]
    assert not [p for p in closed if "compensated by" in p.content], closed
    with runlog.open_run(rid, settings=fast, tools=svc.tools()) as run:
        assert key in run.state.open_calls, "the original closed though nothing was undone"
        assert run.state.open_calls[key].status in ("escalated", "conflict")
        assert key not in run.state.completed_calls
    kinds = [e["kind"] for e in _audit(events) if e["kind"].startswith("compensation")]
    assert "compensation_completed" not in kinds
    assert len(svc.cancels) == 1, "a rejected inverse ran again"
