"""Settling calls whose outcome nobody knows: what a later failure, a lost approval
request and a conflict must never let happen (a second effect nobody decided on).

Effects are counted in the Redis ledger, outside the run; the log is read back from Kafka.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
from workers.common import (
    EFFECTS_WORKER,
    EXIT_ESCALATED,
    Ledger,
    assert_log_sound,
    payloads,
    read_log,
    start_worker,
)

import runlog
from runlog._settings import Settings
from runlog.schemas import _models as m
from runlog.schemas._canonical import canonical_json
from runlog.schemas._keys import new_run_id
from runlog.schemas._vocabulary import EventType

pytestmark = pytest.mark.timeout(120)

ARGS = {"amount": 7, "acct": "A-1"}


def _events(settings: Settings, run_id: str) -> list[m.Event]:
    events = [r.event for r in read_log(settings, run_id)]
    assert_log_sound(events)
    return events


# An effects_worker.py process (same harness as agent_worker.py's).
start = functools.partial(start_worker, script=EFFECTS_WORKER)


def test_a_failed_retry_keeps_an_earlier_uncertain_attempt_governed(
    fast: Settings, ledger: Ledger
) -> None:
    """Attempt 1 times out after taking effect; a person approves a retry; attempt 2 is a
    proven failure. That proves nothing about attempt 1: the call must stay open and a
    re-proposal must not run the key again without a person."""
    invocations: list[str] = []

    @runlog.tool("pay", risk="irreversible")
    def pay(args: dict[str, Any], *, idempotency_key: str) -> str:
        invocations.append(idempotency_key)
        if len(invocations) == 2:
            raise runlog.ToolError("card declined")
        ledger.apply(idempotency_key, canonical_json(args))
        if len(invocations) == 1:
            raise TimeoutError("gateway timed out after accepting")
        return "paid"

    with runlog.open_run(settings=fast, tools=[pay]) as run:
        rid = run.run_id
        with pytest.raises(runlog.Escalated) as first:
            run.call_tool("pay", ARGS)
        assert first.value.approval_id is not None
        with pytest.raises((runlog.Escalated, runlog.ToolFailed)) as second:
            run.decide(first.value.approval_id, approved=True, decided_by="ops")
            run.call_tool("pay", ARGS)
        assert len(invocations) == 2
        # The model proposes the same payment again.
        with pytest.raises(runlog.Escalated) as again:
            run.call_tool("pay", ARGS)
        assert again.value.approval_id not in (None, first.value.approval_id)
        assert isinstance(second.value, runlog.Escalated)
    assert len(invocations) == 2 and ledger.total() == 1, "re-proposal ran the key again"
    events = _events(fast, rid)
    (key,) = set(invocations)
    assert not [p for p in payloads(events, EventType.TOOL_CALL_COMPLETED)]
    unc = payloads(events, EventType.TOOL_CALL_UNCERTAIN)
    assert [u.idempotency_key for u in unc] == [key, key]
    assert "attempt 2 failed (card declined)" in unc[1].error
    kinds = [p.kind for p in payloads(events, EventType.APPROVAL_REQUESTED)]
    assert kinds == ["uncertain_call", "uncertain_call"]


def test_a_failed_retry_after_proven_absence_is_a_plain_failure(
    fast: Settings, ledger: Ledger
) -> None:
    """The lookup proved attempt 1 absent, and the receiver deduplicates by key (so the
    absence is final): a proven failure of the retry is then the whole truth, and the call
    closes as failed."""
    invocations: list[str] = []

    def pay(args: dict[str, Any], *, idempotency_key: str) -> str:
        invocations.append(idempotency_key)
        if len(invocations) == 1:
            raise TimeoutError("gateway did not answer")
        raise runlog.ToolError("card declined")

    def lookup(args: dict[str, Any], *, idempotency_key: str) -> Any:
        return runlog.Absent("no payment with this key")

    tool = runlog.tool("pay", risk="irreversible", reconcile=lookup, dedupes_by_key=True)(pay)
    with runlog.open_run(settings=fast, tools=[tool]) as run:
        rid = run.run_id
        with pytest.raises(runlog.ToolFailed):
            run.call_tool("pay", ARGS)
        assert not run.state.open_calls and not run.state.pending_approvals
    assert len(invocations) == 2
    (failed,) = payloads(_events(fast, rid), EventType.TOOL_CALL_COMPLETED)
    assert failed.is_error and failed.idempotency_key is None


def test_a_conflict_whose_approval_request_was_lost_is_asked_again_and_stops_the_run(
    fast: Settings, tmp_path: Path, ledger: Ledger
) -> None:
    """SIGKILL between the reconciliation that escalates a conflict and its approval
    request: the next owner must ask a person (an approval id to decide) and must not run
    any other effect meanwhile."""
    rid = new_run_id()
    first = start(
        fast,
        tmp_path,
        "first",
        "--run-id",
        rid,
        "--scenario",
        "conflict",
        "--hold-before-escalate",
    )
    first.wait_flag("escalating")
    first.kill()
    events = _events(fast, rid)
    (recon,) = payloads(events, EventType.RECONCILIATION_ATTEMPTED)
    assert (recon.outcome, recon.action) == ("conflict", "escalate")
    assert not payloads(events, EventType.APPROVAL_REQUESTED)

    # The next owner only wants to refund: it must be stopped by the conflict.
    second = start(fast, tmp_path, "second", "--run-id", rid, "--scenario", "refund")
    code, result = second.finish()
    assert ledger.total() == 1, f"an effect ran while a conflict waited: {ledger.per_key()}"
    assert code == EXIT_ESCALATED, f"exit {code}: {result.get('_stderr')}"
    assert result["approval_id"], "escalated with no approval request to decide"
    events = _events(fast, rid)
    (req,) = payloads(events, EventType.APPROVAL_REQUESTED)
    assert req.kind == "conflict" and req.approval_id == result["approval_id"]
    assert req.idempotency_key == recon.idempotency_key
    both = json.loads(req.detail or "")
    assert both["intended"] == ARGS and json.loads(both["found"])["amount"] == 70

    # A person rules the payment must not be repeated: the run goes on, refund runs once.
    runlog.decide(rid, req.approval_id, approved=False, decided_by="ops", settings=fast)
    third = start(fast, tmp_path, "third", "--run-id", rid, "--scenario", "refund")
    code, result = third.finish()
    assert code == 0, result.get("_stderr")
    assert ledger.total() == 2 and result["status"] == "finished"
