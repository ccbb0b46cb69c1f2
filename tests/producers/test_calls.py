"""The tool-call path: every reconciliation outcome, every risk class, people's decisions,
proven failures and intentional repeats, each checked by the exact events it leaves.

Tools change the ledger in Redis (outside the run's state) and count their invocations;
the log is read back from Kafka, never taken from the writer's memory.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import redis
from workers.common import Ledger, read_log, shape, times_out_first, valid_events

import runlog
from runlog._settings import Settings
from runlog.producers._handle import engine_of
from runlog.schemas import _models as m
from runlog.schemas._canonical import canonical_json
from runlog.schemas._vocabulary import EventType

pytestmark = pytest.mark.timeout(60)

ARGS = {"amount": 7, "acct": "A-1"}


class Charge:
    """A charge tool whose first invocations misbehave as told.

    ``first``: what the first invocation does: ``"ok"``; ``"timeout-before"`` (raises
    before reaching the ledger); ``"timeout-after"`` (applies the effect, then the
    response is lost); ``"wrong-after"`` (the receiver applies a different amount, then
    the response is lost); ``"declined"`` (a proven failure).
    """

    def __init__(self, ledger: Ledger, first: str = "ok") -> None:
        self.ledger, self.first = ledger, first
        self.invocations: Counter[str] = Counter()

    def __call__(self, args: dict[str, Any], *, idempotency_key: str) -> str:
        self.invocations[idempotency_key] += 1
        n = sum(self.invocations.values())
        if n == 1 and self.first == "declined":
            raise runlog.ToolError("card declined")
        if n == 1 and self.first == "timeout-before":
            raise TimeoutError("gateway did not answer")
        if n == 1 and self.first == "wrong-after":
            self.ledger.apply(idempotency_key, canonical_json({**args, "amount": 70}))
            raise TimeoutError("gateway timed out after accepting")
        self.ledger.apply(idempotency_key, canonical_json(args))
        if n == 1 and self.first == "timeout-after":
            raise TimeoutError("gateway timed out after accepting")
        return f"charged {args['amount']} to {args['acct']}"

    def lookup(self, args: dict[str, Any], *, idempotency_key: str) -> Any:
        found = self.ledger.found(idempotency_key)
        if found is None:
            return runlog.Absent(f"no ledger entry {idempotency_key}")
        if found != canonical_json(args):
            return runlog.Conflict(found)
        return runlog.Match(f"charged {args['amount']} to {args['acct']}")

    def tool(
        self,
        risk: str = "irreversible",
        reconcile: Callable[..., Any] | None = None,
        receiver: str | None = None,
    ) -> Any:
        return runlog.tool(  # type: ignore[arg-type]
            "charge", risk=risk, reconcile=reconcile, receiver=receiver or self.ledger.honours
        )(self)


_STEPS = {
    EventType.TOOL_CALL_STARTED: ("started", "attempt"),
    EventType.TOOL_CALL_UNCERTAIN: ("uncertain", "detected_by"),
    EventType.RECONCILIATION_ATTEMPTED: ("reconciliation", "outcome", "action"),
    EventType.TOOL_CALL_COMPLETED: ("completed", "source", "is_error"),
    EventType.APPROVAL_REQUESTED: ("approval_requested", "kind"),
}


_LOST: list[tuple[Any, ...]] = [("started", 1), ("uncertain", "live")]
"""A first attempt whose answer was lost, as the writer finds it: every recovery starts here."""


def _shape(events: list[m.Event]) -> list[tuple[Any, ...]]:
    """The facts each recovery step must leave, in order."""
    return shape(events, _STEPS)


def _keys(events: list[m.Event]) -> set[str | None]:
    return {getattr(ev.payload, "idempotency_key", None) for ev in events} - {None}


# ------------------------------------------------------------------------ reconciliation
@pytest.mark.parametrize(
    ("first", "expected", "settles"),
    [
        (
            "timeout-after",
            [
                *_LOST,
                ("reconciliation", "match", "complete"),
                ("completed", "reconciliation", False),
            ],
            "result",
        ),
        (
            "timeout-before",
            [
                *_LOST,
                ("reconciliation", "absent", "retry"),
                ("started", 2),
                ("completed", "live", False),
            ],
            "result",
        ),
        (
            "wrong-after",
            [
                *_LOST,
                ("reconciliation", "conflict", "escalate"),
                ("approval_requested", "conflict"),
            ],
            "escalated",
        ),
    ],
    ids=["match", "absent", "conflict"],
)
def test_reconciliation_outcomes(
    first: str, expected: list[tuple[Any, ...]], settles: str, fast: Settings, ledger: Ledger
) -> None:
    # The live attempt's own request is in doubt, under this owner's token: only a
    # receiver that deduplicates by key makes the lookup's absence final here.
    charge = Charge(Ledger(ledger.redis, fast.redis_key_prefix, "dedupes_by_key"), first)
    with runlog.open_run(settings=fast, tools=[charge.tool(reconcile=charge.lookup)]) as run:
        seq = run.state.seq
        if settles == "result":
            assert run.call_tool("charge", ARGS) == "charged 7 to A-1"
        else:
            with pytest.raises(runlog.Escalated) as info:
                run.call_tool("charge", ARGS)
            assert info.value.approval_id in run.state.approvals
            assert run.state.status == "escalated"
            with pytest.raises(runlog.Escalated):  # the run stays stopped
                run.call_tool("charge", {"amount": 1, "acct": "B"})
        state = run.state
    events = valid_events(fast, run.run_id, after_seq=seq)
    assert _shape(events) == expected
    (key,) = _keys(events)
    assert sum(charge.invocations.values()) == (2 if first == "timeout-before" else 1)
    assert set(charge.invocations) == {key}  # a retry reuses the key, never a new one
    if settles == "result":
        assert ledger.per_key() == {key: 1} and state.completed_calls == {key: "charged 7 to A-1"}
    else:
        req = events[-1].payload
        assert isinstance(req, m.ApprovalRequested) and req.detail is not None
        both = json.loads(req.detail)
        assert both["intended"] == ARGS and json.loads(both["found"])["amount"] == 70
        assert req.idempotency_key == key and key not in state.completed_calls


def test_reconciliation_unavailable_keeps_the_call_uncertain_and_never_retries(
    fast: Settings, ledger: Ledger
) -> None:
    charge = Charge(ledger, "timeout-before")

    def down(args: dict[str, Any], *, idempotency_key: str) -> Any:
        return runlog.Inconclusive("ledger query timed out")

    with runlog.open_run(settings=fast, tools=[charge.tool(risk="safe", reconcile=down)]) as run:
        seq = run.state.seq
        with pytest.raises(runlog.CallUncertain):
            run.call_tool("charge", ARGS)
        with pytest.raises(runlog.CallUncertain):  # asking again reaches the same key
            run.call_tool("charge", ARGS)
        (key,) = run.state.open_calls
        assert run.state.open_calls[key].status == "uncertain"
    events = valid_events(fast, run.run_id, after_seq=seq)
    assert _shape(events) == [
        *_LOST,
        ("reconciliation", "unavailable", "keep_uncertain"),
        ("reconciliation", "unavailable", "keep_uncertain"),
    ]
    assert _keys(events) == {key}
    assert sum(charge.invocations.values()) == 1 and ledger.total() == 0


# ------------------------------------------------------------------------ risk classes
@pytest.mark.parametrize(
    ("risk", "action"), [("safe", "retry"), ("reversible", "retry_compensate")]
)
def test_without_reconciler_safe_and_reversible_calls_are_retried(
    risk: str, action: str, fast: Settings, ledger: Ledger
) -> None:
    charge = Charge(ledger, "timeout-before")
    with runlog.open_run(settings=fast, tools=[charge.tool(risk=risk)]) as run:
        seq = run.state.seq
        assert run.call_tool("charge", ARGS) == "charged 7 to A-1"
    events = valid_events(fast, run.run_id, after_seq=seq)
    assert _shape(events) == [
        *_LOST,
        ("reconciliation", "no_reconciler", action),
        ("started", 2),
        ("completed", "live", False),
    ]
    (key,) = _keys(events)
    assert charge.invocations == {key: 2} and ledger.per_key() == {key: 1}


def _escalated_irreversible(fast: Settings, charge: Charge) -> tuple[str, str, int]:
    with runlog.open_run(settings=fast, tools=[charge.tool()]) as run:
        seq = run.state.seq
        with pytest.raises(runlog.Escalated) as info:
            run.call_tool("charge", ARGS)
        approval_id = info.value.approval_id
        assert approval_id is not None
        assert run.state.status == "running"  # only this call waits, not the run
    events = valid_events(fast, run.run_id, after_seq=seq)
    assert _shape(events) == [
        *_LOST,
        ("reconciliation", "no_reconciler", "escalate"),
        ("approval_requested", "uncertain_call"),
    ]
    req = events[-1].payload
    started = events[0].payload
    assert isinstance(req, m.ApprovalRequested) and isinstance(started, m.ToolCallStarted)
    assert req.approval_id == approval_id and req.idempotency_key == started.idempotency_key
    assert req.args_json == started.args_json and req.started_at == events[0].occurred_at
    assert req.last_error == "TimeoutError: gateway did not answer"
    return run.run_id, approval_id, events[-1].seq


def test_irreversible_without_reconciler_waits_for_approval_then_retries_same_key(
    fast: Settings, ledger: Ledger
) -> None:
    charge = Charge(ledger, "timeout-before")
    rid, approval_id, seq = _escalated_irreversible(fast, charge)
    # Resuming without a decision does not execute it.
    with (
        runlog.open_run(rid, settings=fast, tools=[charge.tool()]) as run,
        pytest.raises(runlog.Escalated),
    ):
        run.call_tool("charge", ARGS)
    assert sum(charge.invocations.values()) == 1

    got = runlog.decide(
        rid,
        approval_id,
        approved=True,
        decided_by="ops@example",
        tools=[charge.tool()],
        settings=fast,
    )
    assert got == "recorded"
    events = valid_events(fast, rid, after_seq=seq)
    assert _shape(events) == [
        ("run_resumed",),
        ("run_resumed",),
        ("approval_decided",),
        ("reconciliation", "decided", "retry"),
        ("started", 2),
        ("completed", "live", False),
    ]
    (key,) = charge.invocations
    assert charge.invocations == {key: 2} and _keys(events) == {key}
    assert ledger.per_key() == {key: 1}
    decided = events[2].payload
    assert isinstance(decided, m.ApprovalDecided) and decided.decided_by == "ops@example"


def test_irreversible_rejected_by_a_person_completes_with_the_note_and_never_runs(
    fast: Settings, ledger: Ledger
) -> None:
    charge = Charge(ledger, "timeout-before")
    rid, approval_id, seq = _escalated_irreversible(fast, charge)
    got = runlog.decide(
        rid, approval_id, approved=False, decided_by="ops", note="customer cancelled", settings=fast
    )
    assert got == "recorded"
    events = valid_events(fast, rid, after_seq=seq)
    assert _shape(events) == [
        ("run_resumed",),
        ("approval_decided",),
        ("reconciliation", "decided", "resolve"),
        ("completed", "reconciliation", False),
    ]
    done = events[-1].payload
    assert isinstance(done, m.ToolCallCompleted) and "customer cancelled" in done.content
    # Re-executing the worker's code from the top finds the call settled by the person.
    with runlog.open_run(rid, settings=fast, tools=[charge.tool()]) as run:
        assert run.call_tool("charge", ARGS) == done.content
    assert sum(charge.invocations.values()) == 1 and ledger.total() == 0


def test_decision_while_the_run_is_owned_is_queued_and_recorded_by_the_owner(
    fast: Settings, ledger: Ledger
) -> None:
    charge = Charge(ledger, "timeout-before")
    rid, approval_id, seq = _escalated_irreversible(fast, charge)
    with runlog.open_run(rid, settings=fast, tools=[charge.tool()]) as run:
        got = runlog.decide(rid, approval_id, approved=True, decided_by="ops", settings=fast)
        assert got == "queued"
        assert sum(charge.invocations.values()) == 1
        assert run.poll_decisions() == 1
        assert run.call_tool("charge", ARGS) == "charged 7 to A-1"
        assert run.poll_decisions() == 0  # the inbox entry is gone once recorded
    events = valid_events(fast, rid, after_seq=seq)
    assert _shape(events) == [
        ("run_resumed",),
        ("approval_decided",),
        ("reconciliation", "decided", "retry"),
        ("started", 2),
        ("completed", "live", False),
    ]
    assert sum(charge.invocations.values()) == 2 and ledger.total() == 1


# ------------------------------------------------------------------------ failures, repeats
def test_a_proven_failure_records_no_key_and_an_identical_call_runs_again(
    fast: Settings, ledger: Ledger
) -> None:
    charge = Charge(ledger, "declined")
    with runlog.open_run(settings=fast, tools=[charge.tool()]) as run:
        seq = run.state.seq
        with pytest.raises(runlog.ToolFailed, match="card declined"):
            run.call_tool("charge", ARGS)
        assert not run.state.open_calls and not run.state.completed_calls
        assert run.call_tool("charge", ARGS) == "charged 7 to A-1"
    events = valid_events(fast, run.run_id, after_seq=seq)
    assert _shape(events) == [
        ("started", 1),
        ("completed", "live", True),
        ("started", 1),
        ("completed", "live", False),
    ]
    failed = events[1].payload
    assert isinstance(failed, m.ToolCallCompleted)
    assert failed.idempotency_key is None and failed.content == "card declined"
    assert sum(charge.invocations.values()) == 2 and ledger.total() == 1


def test_two_intentional_charges_are_two_actions(fast: Settings, ledger: Ledger) -> None:
    charge = Charge(ledger)
    with runlog.open_run(settings=fast, tools=[charge.tool()]) as run:
        seq = run.state.seq
        first_key = run.key_for("charge", ARGS)
        run.call_tool("charge", ARGS)
        second_key = run.key_for("charge", ARGS)
        run.call_tool("charge", dict(reversed(ARGS.items())))  # same action, other key order
        assert first_key != second_key
        assert set(run.state.completed_calls) == {first_key, second_key}
    events = valid_events(fast, run.run_id, after_seq=seq)
    assert _keys(events) == {first_key, second_key}
    assert ledger.per_key() == {first_key: 1, second_key: 1}


def test_a_retry_after_a_proven_failure_keeps_its_key_so_a_re_execution_does_not_repeat_it(
    fast: Settings, ledger: Ledger
) -> None:
    """Regression: the retry used a fresh key, so re-executing the worker from the top
    recomputed the failed key, found it unsettled and charged a second time."""
    charge = Charge(ledger, "declined")

    def worker(run: runlog.Run) -> str:  # the user's code, re-executed from the top
        try:
            return run.call_tool("charge", ARGS)
        except runlog.ToolFailed:
            return run.call_tool("charge", ARGS)

    with runlog.open_run(settings=fast, tools=[charge.tool()]) as run:
        key = run.key_for("charge", ARGS)
        assert worker(run) == "charged 7 to A-1"
        assert set(run.state.completed_calls) == {key}  # the retry completed the same key
    # The process dies and a supervisor re-runs the worker on the same run.
    with runlog.open_run(run.run_id, settings=fast, tools=[charge.tool()]) as again:
        assert worker(again) == "charged 7 to A-1"
    assert ledger.total() == 1 and ledger.per_key() == {key: 1}
    assert sum(charge.invocations.values()) == 2  # the declined try and the one success


def test_a_persons_approval_is_honoured_after_the_attempt_cap(
    fast: Settings, ledger: Ledger
) -> None:
    """Regression: after MAX_ATTEMPTS an approved retry re-escalated instead of running."""
    from runlog.producers._calls import MAX_ATTEMPTS

    flaky, calls = times_out_first("flaky", MAX_ATTEMPTS, "done")
    with runlog.open_run(settings=fast, tools=[flaky]) as run:
        with pytest.raises(runlog.Escalated) as esc:
            run.call_tool("flaky", {"n": 1})
        assert len(calls) == MAX_ATTEMPTS
        assert esc.value.approval_id is not None
        run.decide(esc.value.approval_id, approved=True, decided_by="ops", note="go on")
        key = run.key_for("flaky", {"n": 1})
        assert run.state.completed_calls == {key: "done"}
        assert not run.state.pending_approvals
    assert len(calls) == MAX_ATTEMPTS + 1 and set(calls) == {key}


def test_a_conflict_stops_every_other_effect_until_a_person_decides(
    fast: Settings, ledger: Ledger
) -> None:
    """Conflict stops the run: recovery must not retry other uncertain calls meanwhile."""
    wrong = Charge(ledger, "wrong-after")
    lost = Charge(ledger, "timeout-before")

    def unavailable(args: dict[str, Any], *, idempotency_key: str) -> Any:
        return runlog.Inconclusive("ledger lookup is down")

    def tools(reconcile_charge: Any, reconcile_refund: Any) -> list[Any]:
        refund = runlog.tool("refund", risk="safe", reconcile=reconcile_refund)(lost)  # type: ignore[arg-type]
        return [wrong.tool(reconcile=reconcile_charge), refund]

    # Both calls end uncertain while the lookup is down.
    with runlog.open_run(settings=fast, tools=tools(unavailable, unavailable)) as run:
        rid = run.run_id
        for name in ("charge", "refund"):
            with pytest.raises(runlog.CallUncertain):
                run.call_tool(name, ARGS)
    # The lookup is back: the charge conflicts (70 applied, 7 intended), the refund is
    # provably absent; but the run is stopped, so the refund must wait for a person.
    with runlog.open_run(rid, settings=fast, tools=tools(wrong.lookup, lost.lookup)) as run:
        assert run.state.status == "escalated"
        assert len(run.state.open_calls) == 2
        with pytest.raises(runlog.Escalated):
            run.call_tool("refund", ARGS)
    assert sum(lost.invocations.values()) == 1  # only the original, lost attempt
    started = [
        r.event.payload.name  # type: ignore[attr-defined]
        for r in read_log(fast, rid)
        if r.event.type is EventType.TOOL_CALL_STARTED
    ]
    assert started == ["charge", "refund"]  # no retry of anything after the conflict


def test_a_malformed_queued_decision_is_set_aside_not_lost_and_never_blocks_the_run(
    fast: Settings, redis_client: redis.Redis
) -> None:
    from runlog.producers._approvals import decisions_key

    with runlog.open_run(settings=fast) as run:
        rid = run.run_id
        deps = engine_of(run).deps
    inbox = decisions_key(deps, "default", rid)
    redis_client.rpush(inbox, b"{not json")
    with runlog.open_run(rid, settings=fast) as again:
        assert again.state.status == "running"
    assert redis_client.lrange(inbox, 0, -1) == []
    assert redis_client.lrange(inbox + ":malformed", 0, -1) == [b"{not json"]


def test_a_reconciler_returning_garbage_counts_as_no_evidence(
    fast: Settings, ledger: Ledger
) -> None:
    charge = Charge(ledger, "timeout-after")
    tool = charge.tool(reconcile=lambda args, *, idempotency_key: None)
    with runlog.open_run(settings=fast, tools=[tool]) as run:
        with pytest.raises(runlog.CallUncertain):
            run.call_tool("charge", ARGS)
        call = next(iter(run.state.open_calls.values()))
        assert call.last_evidence is not None and "unavailable" in call.last_evidence
    assert sum(charge.invocations.values()) == 1  # never retried on no evidence
