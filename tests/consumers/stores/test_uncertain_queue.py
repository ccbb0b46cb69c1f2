"""The uncertain-call queue and the audit trail, fed by real writers and their recovery."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import redis
from projections_support import replayed_states

import runlog
from runlog._settings import Settings
from runlog.consumers import _queries as queries
from runlog.consumers.runner import ProjectionRunner
from runlog.consumers.stores import PROJECTIONS
from runlog.log._reader import LogReader
from runlog.schemas import _models as m

pytestmark = pytest.mark.timeout(120)


class Crash(BaseException):
    """Not an Exception: the worker dies between STARTED and any outcome."""


def _flaky(result: str) -> Any:
    """A tool whose first call times out (outcome unknown) and later calls succeed."""
    seen: list[str] = []

    def fn(args: dict[str, Any], *, idempotency_key: str) -> str:
        seen.append(idempotency_key)
        if len(seen) == 1:
            raise TimeoutError("gateway timed out after the request was sent")
        return result

    return fn


def test_uncertain_queue_from_real_recovery(
    test_settings: Settings, redis_client: redis.Redis
) -> None:
    s = test_settings
    match = runlog.tool("pay", risk="irreversible", reconcile=lambda a, **k: runlog.Match("p-1"))(
        _flaky("p-1")
    )
    absent = runlog.tool("mail", risk="safe", reconcile=lambda a, **k: runlog.Absent("no mail"))(
        _flaky("sent")
    )
    conflict = runlog.tool(
        "book", risk="reversible", reconcile=lambda a, **k: runlog.Conflict("seat 2B not 1A")
    )(_flaky("booked"))
    unavailable = runlog.tool(
        "wire", risk="irreversible", reconcile=lambda a, **k: runlog.Inconclusive("bank down")
    )(_flaky("wired"))

    def ship_fn(args: dict[str, Any], *, idempotency_key: str) -> str:
        raise Crash()

    ship = runlog.tool("ship", risk="irreversible")(ship_fn)

    with runlog.open_run(tools=[match, absent, unavailable], settings=s) as run_a:
        run_a.append("user_message", content="go")
        assert run_a.call_tool("pay", {"n": 1}) == "p-1"  # Match -> completed by evidence
        assert run_a.call_tool("mail", {"to": "x"}) == "sent"  # Absent -> retried, same key
        with pytest.raises(runlog.CallUncertain):
            run_a.call_tool("wire", {"eur": 5})  # Inconclusive -> stays uncertain
        wire_key = next(iter(run_a.state.open_calls))
        wire_started = run_a.state.open_calls[wire_key].started_at
        run_a.finish("done")
    with runlog.open_run(tools=[conflict], settings=s) as run_b:
        with pytest.raises(runlog.Escalated):
            run_b.call_tool("book", {"seat": "1A"})  # Conflict -> escalated, run stops
        book_key = next(iter(run_b.state.open_calls))
        book_started = run_b.state.open_calls[book_key].started_at
    run_c = runlog.open_run(tools=[ship], settings=s)
    with pytest.raises(Crash):
        run_c.call_tool("ship", {"box": 7})
    run_c.close()  # the worker is gone; a new owner resumes and escalates (irreversible)
    with runlog.open_run(run_c.run_id, tools=[ship], settings=s) as run_c2:
        (ship_call,) = run_c2.state.open_calls.values()
        assert ship_call.status == "escalated"
        approval = ship_call.approval_id
        assert approval is not None
        run_c2.decide(approval, approved=False, decided_by="alice", note="never shipped")
        assert not run_c2.state.open_calls

    ProjectionRunner(s, redis_client, PROJECTIONS).catch_up(timeout_s=60)
    latest = max(wire_started, book_started)

    rep = queries.uncertain_report(redis_client, s, now=latest + timedelta(minutes=20))
    assert rep.counters == {
        "opened": 5,  # pay, mail, wire, book (TOOL_CALL_UNCERTAIN) and ship (RUN_RESUMED)
        "reconciled": 1,  # pay: completed with source=reconciliation
        "retried": 1,  # mail: a second attempt with the same key completed
        "decided": 1,  # ship: a person ruled it must not run again
        "escalated": 2,  # book (conflict) and ship (irreversible without lookup)
    }
    by_tool = {c["tool"]: c for c in rep.open}
    assert sorted(by_tool) == ["book", "wire"]
    assert by_tool["wire"]["status"] == "uncertain"
    assert by_tool["wire"]["idempotency_key"] == wire_key
    assert by_tool["wire"]["last_evidence"] == "unavailable: bank down"
    assert by_tool["wire"]["args_json"] == '{"eur":5}'
    assert by_tool["book"]["status"] == "conflict"
    assert by_tool["book"]["risk"] == "reversible"
    assert by_tool["book"]["attempts"] == 1
    # Ages are measured from the writers' own STARTED times, at query time.
    now = latest + timedelta(minutes=20)
    assert by_tool["wire"]["age_s"] == pytest.approx((now - wire_started).total_seconds())
    assert rep.oldest_age_s["reversible"] == pytest.approx((now - book_started).total_seconds())
    # 20 min: the irreversible wire is past 15 min, the reversible booking not yet past 1 h.
    assert [o["tool"] for o in rep.overdue] == ["wire"]
    later = queries.uncertain_report(redis_client, s, now=latest + timedelta(hours=2))
    assert sorted(o["tool"] for o in later.overdue) == ["book", "wire"]
    custom = queries.uncertain_report(
        redis_client, s, now=latest + timedelta(minutes=20), deadlines_s={"irreversible": 3600}
    )
    assert custom.overdue == []

    # Audit: reconciliation decisions, the retry, the resumption and the person's latency.
    audit_a = queries.get_audit(redis_client, s, run_a.run_id)
    outcomes = [
        (e["tool"], e["outcome"], e["action"]) for e in audit_a if e["kind"] == "reconciliation"
    ]
    assert outcomes == [
        ("pay", "match", "complete"),
        ("mail", "absent", "retry"),
        ("wire", "unavailable", "keep_uncertain"),
    ]
    assert [(e["tool"], e["attempt"]) for e in audit_a if e["kind"] == "retry"] == [("mail", 2)]
    audit_c = queries.get_audit(redis_client, s, run_c.run_id)
    (resumed,) = [e for e in audit_c if e["kind"] == "resumption"]
    (decided,) = [e for e in audit_c if e["kind"] == "approval_decided"]
    with LogReader(s) as reader:
        events = [r.event for r in reader.read(run_c.run_id)]
    req = next(e for e in events if isinstance(e.payload, m.ApprovalRequested))
    dec = next(e for e in events if isinstance(e.payload, m.ApprovalDecided))
    res = next(e for e in events if isinstance(e.payload, m.RunResumed))
    assert decided["decided_by"] == "alice" and decided["approved"] is False
    assert decided["latency_ms"] == round(
        (dec.occurred_at - req.occurred_at).total_seconds() * 1000
    )
    assert isinstance(res.payload, m.RunResumed)
    assert res.payload.gap_ms is not None
    assert resumed["gap_ms"] == res.payload.gap_ms

    # And the state projection still equals the writers' fold for these runs.
    runs = [run_a.run_id, run_b.run_id, run_c.run_id]
    expected = replayed_states(s, runs)
    for rid in runs:
        view = queries.get_state(redis_client, s, rid)
        assert view is not None and view["state"] == expected[rid]
    assert expected[run_b.run_id]["status"] == "escalated"
