"""The question a person answers about an uncertain call, on the real stack: what may have
happened (tool, canonical arguments, key, start time and attempts, last transport error,
each reconciliation step) and what each answer does, from ``runlog.question``,
``runlog explain`` and ``runlog show``, read from the log without the tools."""

from __future__ import annotations

import json
from typing import Any

import pytest
from projections_support import env_for

import runlog
from runlog._settings import Settings

pytestmark = pytest.mark.timeout(180)


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    from runlog.cli import main

    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _timeout(args: dict[str, Any], *, idempotency_key: str) -> str:
    raise TimeoutError("read timed out after 5.0s (the request was sent)")


def test_question_of_an_uncertain_payment_says_a_retry_may_pay_twice(
    test_settings: Settings, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    s = test_settings
    for k, v in env_for(s).items():
        monkeypatch.setenv(k, v)
    pay = runlog.tool("pay", risk="irreversible")(_timeout)  # no lookup, no deduplication
    with runlog.open_run(tenant="acme", tools=[pay], settings=s) as run:
        with pytest.raises(runlog.Escalated):
            run.call_tool("pay", {"to": "A-1", "amount": 7})
        (ap,) = run.state.pending_approvals
        rid = run.run_id
    # Read by someone without the tools: the log alone says it all.
    q = runlog.question(rid, ap, tenant="acme", settings=s)
    assert isinstance(q, runlog.Question)
    assert (q.kind, q.tool, q.risk) == ("uncertain_call", "pay", "irreversible")
    assert json.loads(q.args_json or "") == {"amount": 7, "to": "A-1"}
    assert q.args_json == '{"amount":7,"to":"A-1"}'  # canonical: sorted, compact
    key = q.idempotency_key
    assert key and q.started_at and len(q.attempts) == 1
    assert q.attempts[0].outcome == "uncertain" and q.attempts[0].started_at == q.started_at
    assert q.last_error is not None and "read timed out after 5.0s" in q.last_error
    ((recon),) = q.reconciliations
    assert (recon.outcome, recon.action) == ("no_reconciler", "escalate")
    assert q.dedupes_by_key is False and q.decided is None
    assert f"retry pay with the same key {key}" in q.approve
    assert "NOT declared to deduplicate" in q.approve and "REPEATS" in q.approve
    assert "without retrying" in q.reject and "its effect stands" in q.reject
    sure = q.confirmation(True)
    assert f"Retry pay with key {key}" in sure and "REPEATS" in sure

    rc, out, err = _cli(capsys, "explain", rid, ap, "--tenant", "acme")
    assert rc == 0, err
    for fact in (key, '{"amount":7,"to":"A-1"}', q.started_at, "read timed out after 5.0s"):
        assert fact in out
    assert "no_reconciler -> escalate" in out and q.approve in out and q.reject in out
    rc, out, err = _cli(capsys, "explain", rid, ap, "--tenant", "acme", "--json")
    assert rc == 0, err
    assert json.loads(out)["confirm_approve"] == sure
    rc, out, err = _cli(capsys, "show", rid, "--tenant", "acme")
    assert rc == 0, err
    assert "waiting for a person:" in out and q.approve in out
    # Another tenant's run is not found, as `runlog approve` answers it (exit 4).
    rc, theirs, _ = _cli(capsys, "explain", rid, ap, "--tenant", "globex")
    assert rc == 4 and theirs == ""

    runlog.decide(
        rid, ap, approved=False, decided_by="ann", note="paid by hand", tenant="acme", settings=s
    )
    after = runlog.question(rid, ap, tenant="acme", settings=s)
    assert after.decided is not None and "ann" in after.decided and "paid by hand" in after.decided


def test_question_of_a_deduplicated_reversible_call_says_a_retry_is_safe_and_reject_undoes(
    test_settings: Settings,
) -> None:
    s = test_settings
    undone: list[str] = []

    def undo(args: dict[str, Any], *, idempotency_key: str, original_key: str) -> str:
        undone.append(original_key)
        return "released"

    hold = runlog.tool("hold", risk="reversible", compensate=undo, dedupes_by_key=True)(_timeout)
    with runlog.open_run(tools=[hold], settings=s) as run:
        with pytest.raises(runlog.Escalated):  # every attempt timed out: a person decides
            run.call_tool("hold", {"seat": "1A"})
        (ap,) = run.state.pending_approvals
        rid = run.run_id
    q = runlog.question(rid, ap, settings=s)
    assert [a.attempt for a in q.attempts] == [1, 2, 3, 4, 5]
    assert all(a.outcome == "uncertain" for a in q.attempts)
    assert [r.action for r in q.reconciliations] == ["retry_compensate"] * 5 + ["escalate"]
    assert q.started_at == q.attempts[0].started_at < q.attempts[-1].started_at
    assert (q.dedupes_by_key, q.compensable) == (True, True)
    assert "declared to deduplicate by this key" in q.approve and "REPEATS" not in q.approve
    assert "not repeated" in q.confirmation(True)
    assert "inverse" in q.reject and "undo" in q.reject
    assert undone == []  # asking changes nothing
