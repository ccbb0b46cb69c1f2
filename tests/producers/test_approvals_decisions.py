"""A person's decision is final: the first valid decision in the log stands.

* ``runlog approve``/``reject`` as real processes, in both orders: the first stands, the
  second exits 1 naming it (who, approve or reject, note, when), and the log holds one
  decision.
* Two deciders released together from a barrier: exactly one is accepted, the other is
  refused with ``DecisionConflict`` naming the one that stands.
* A second decision that got into the log anyway (a writer that did not ask the rule) is
  record-only: the fold keeps the first, ``runlog show`` and the audit say "superseded".
* A stale owner (Redis restored from before a takeover) cannot swallow a queued decision:
  its fenced record does not count, the decision stays in the inbox and the next owner
  records it.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis
from projections_support import env_for
from ui_support import TOKEN_ADMIN, console
from workers.common import assert_log_sound, read_log, services_for, verdicts

import runlog
from runlog._bootstrap import Services
from runlog._settings import Settings
from runlog.consumers._queries import get_audit
from runlog.consumers.runner import ProjectionRunner
from runlog.consumers.stores import PROJECTIONS
from runlog.errors import DecisionConflict
from runlog.producers._approvals import decisions_key
from runlog.producers._handle import engine_of
from runlog.projections import _audit as audit
from runlog.projections._run_state import RunState, accept
from runlog.schemas._vocabulary import EventType

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def s(test_settings: Settings) -> Iterator[Settings]:
    with services_for(test_settings):
        yield test_settings


def _waiting(s: Settings) -> tuple[str, str]:
    """A free run (no worker holds it) with one action approval waiting for a person."""
    with runlog.open_run(settings=s, goal="refund") as run:
        ap = run.request_approval("refund 7 EUR to A-1")
        return run.run_id, ap


def _cli(s: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "runlog.cli", *args],
        env=env_for(s),
        capture_output=True,
        text=True,
        timeout=60,
    )


def _decisions(s: Settings, run_id: str) -> list[tuple[str, bool, bool]]:
    """(decided_by, approved, valid) of every APPROVAL_DECIDED in the run's log."""
    events = [r.event for r in read_log(s, run_id)]
    return [
        (ev.payload.decided_by, ev.payload.approved, ok)  # type: ignore[union-attr]
        for ev, ok in verdicts(events)
        if ev.type is EventType.APPROVAL_DECIDED
    ]


@pytest.mark.parametrize(("first", "second"), [("approve", "reject"), ("reject", "approve")])
def test_the_first_decision_stands_and_a_second_is_refused_by_the_cli(
    s: Settings, first: str, second: str
) -> None:
    rid, ap = _waiting(s)
    one = _cli(s, first, rid, ap, "--by", "ops-1", "--note", "checked the ledger")
    assert one.returncode == 0, one.stderr
    two = _cli(s, second, rid, ap, "--by", "ops-2", "--note", "changed my mind")
    assert two.returncode == 1, (two.stdout, two.stderr)
    verb = "approved" if first == "approve" else "rejected"
    assert "ops-1" in two.stderr and verb in two.stderr and "checked the ledger" in two.stderr
    assert "recorded in" not in two.stdout
    assert _decisions(s, rid) == [("ops-1", first == "approve", True)]
    state = runlog.open_run(rid, settings=s, recover=False)
    try:
        assert state.state.approvals[ap].decided_by == "ops-1"
    finally:
        state.close()


def test_two_deciders_released_together_one_is_accepted(s: Settings) -> None:
    rid, ap = _waiting(s)
    gate = threading.Barrier(2)
    outcomes: dict[str, Any] = {}

    def decider(name: str, approved: bool) -> None:
        gate.wait()
        try:
            outcomes[name] = runlog.decide(
                rid, ap, approved=approved, decided_by=name, settings=s, note=name
            )
        except DecisionConflict as exc:
            outcomes[name] = exc

    threads = [
        threading.Thread(target=decider, args=("ops-1", True)),
        threading.Thread(target=decider, args=("ops-2", False)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    accepted = [n for n, o in outcomes.items() if o == "recorded"]
    refused = {n: o for n, o in outcomes.items() if isinstance(o, DecisionConflict)}
    assert len(accepted) == 1 and len(refused) == 1, outcomes
    (winner,) = accepted
    (conflict,) = refused.values()
    assert conflict.decided_by == winner and conflict.approved is (winner == "ops-1")
    assert conflict.decided_at is not None and conflict.note == winner
    valid = [d for d in _decisions(s, rid) if d[2]]
    assert valid == [(winner, winner == "ops-1", True)]
    svc = Services.shared(s)
    assert svc.redis.llen(decisions_key(svc.run_deps(), "default", rid)) == 0


def test_a_decision_after_the_standing_one_is_superseded_everywhere(
    s: Settings, redis_client: redis.Redis
) -> None:
    rid, ap = _waiting(s)
    assert runlog.decide(rid, ap, approved=True, decided_by="ops-1", settings=s) == "recorded"
    ProjectionRunner(s, redis_client, PROJECTIONS).catch_up(timeout_s=60)
    # A writer that never asks the rule (an older version, a bug) appends a second one.
    with runlog.open_run(rid, settings=s, recover=False) as run:
        run.append(EventType.APPROVAL_DECIDED, approval_id=ap, approved=False, decided_by="ops-2")
        assert run.state.approvals[ap].approved is True
    events = [r.event for r in read_log(s, rid)]
    assert_log_sound(events)

    st = RunState()
    for ev in events:
        accept(st, ev)
    assert st.approvals[ap].approved is True and st.approvals[ap].decided_by == "ops-1"

    shown = _cli(s, "show", rid)
    assert shown.returncode == 0, shown.stderr
    line = next(x for x in shown.stdout.splitlines() if "ops-2" in x)
    assert (
        line.startswith("s ") and f"superseded: approval {ap} already decided by ops-1 at" in line
    )

    run_audit, entries = audit.AuditRun(), []
    for rec in read_log(s, rid):
        entries += audit.apply_event(run_audit, rec.event, rec.partition, rec.offset)
    kinds = [(e["kind"], e.get("decided_by")) for e in entries if "approval_id" in e]
    assert kinds == [
        ("approval_requested", None),
        ("approval_decided", "ops-1"),
        ("approval_superseded", "ops-2"),
    ]
    sup = entries[[e["kind"] for e in entries].index("approval_superseded")]
    assert sup["superseded_by"] == "ops-1" and sup["standing_approved"] is True
    first = entries[[e["kind"] for e in entries].index("approval_decided")]["at"]
    assert sup["standing_at"] == first
    assert sup["text"].startswith(f"superseded: approval {ap} already decided by ops-1 at {first}")

    # The audit projection's store, its runner restarted in between (what it knows of the
    # standing decision comes back from Redis), says the same.
    ProjectionRunner(s, redis_client, PROJECTIONS).catch_up(timeout_s=60)
    stored = [e for e in get_audit(redis_client, s, rid) if "approval_id" in e]
    assert [e["kind"] for e in stored] == [e["kind"] for e in entries if "approval_id" in e]
    assert stored[-1]["text"] == sup["text"] and stored[-1]["standing_at"] == first

    # The console's run page tells it the same way, marked apart from the standing one.
    with console(s) as base:
        page = httpx.get(f"{base}/runs/{rid}", headers={"Authorization": f"Bearer {TOKEN_ADMIN}"})
    assert page.status_code == 200
    row = page.text[page.text.index('<tr class="superseded">') :]
    row = row[: row.index("</tr>")]
    assert "ops-2" in row and f"superseded: approval {ap} already decided by ops-1 at" in row


def test_a_request_under_a_decided_id_is_refused_and_the_decision_stands(s: Settings) -> None:
    """The first request of an approval id stands: a writer refuses a repeat (naming the
    first's seq) before anything reaches the log, so a decided request is never reopened;
    a repeat written anyway is ignored by every reader (tests/projections/test_notify_rules)."""
    rid, ap = _waiting(s)
    assert runlog.decide(rid, ap, approved=False, decided_by="ops-1", settings=s) == "recorded"
    with runlog.open_run(rid, settings=s, recover=False) as run:
        before = run.state.seq
        with pytest.raises(ValueError, match=ap) as err:
            run.append(
                EventType.APPROVAL_REQUESTED, approval_id=ap, kind="action", reason="once more"
            )
        assert "first request stands" in str(err.value)
        assert run.state.seq == before and run.state.approvals[ap].approved is False
    events = [r.event for r in read_log(s, rid)]
    assert [e.type for e in events].count(EventType.APPROVAL_REQUESTED) == 1


@pytest.fixture
def slow_lease(test_settings: Settings) -> Iterator[Settings]:
    """A long TTL: no renewal runs during the test, so only the restored keys speak."""
    st = test_settings.model_copy(update={"lease_ttl_ms": 30_000})
    with services_for(st):
        yield st


def test_a_stale_owner_does_not_swallow_a_queued_decision(
    slow_lease: Settings, redis_client: redis.Redis
) -> None:
    s = slow_lease
    a = runlog.open_run(settings=s)
    rid = a.run_id
    ap = a.request_approval("refund 7 EUR to A-1")
    svc = Services.shared(s)
    keys = [svc.leases.lease_key(a.tenant, rid), svc.leases.epoch_key(a.tenant, rid)]
    before = [(k, redis_client.dump(k), redis_client.pttl(k)) for k in keys]
    b = runlog.open_run(rid, settings=s, takeover=True, recover=False)
    assert b.epoch == 2
    for k, blob, ttl in before:  # Redis forgets the takeover: A's checks pass again
        assert blob is not None
        redis_client.restore(k, max(ttl, 0), blob, replace=True)
    assert engine_of(a).lease.check()

    # The person decides while "A" holds the run: the decision is queued for its owner.
    decided = _cli(s, "approve", rid, ap, "--by", "ops-1", "--note", "ok")
    assert decided.returncode == 0, decided.stderr
    assert "queued" in decided.stdout
    inbox = decisions_key(svc.run_deps(), "default", rid)
    assert redis_client.llen(inbox) == 1

    # A records it as a fenced write: that must not take it out of the inbox.
    with pytest.raises(runlog.Fenced):
        a.poll_decisions()
    a.close()
    assert redis_client.llen(inbox) == 1, "a stale owner swallowed the person's decision"

    b.close()
    # The next owner reads the inbox before anything else may act, and records it.
    with runlog.open_run(rid, settings=s) as c:
        assert c.state.approvals[ap].approved is True
        assert c.state.approvals[ap].decided_by == "ops-1"
    assert redis_client.llen(inbox) == 0
    got = _decisions(s, rid)
    assert [d for d in got if d[2]] == [("ops-1", True, True)]
    assert [d for d in got if not d[2]] == [("ops-1", True, False)]  # A's, fenced


def _escalated_call(s: Settings, pay: runlog.Tool) -> tuple[str, str]:
    """A run whose irreversible call has no known outcome and no reconciler: recovery
    escalates it to a person (approve = retry with the same key, reject = do not)."""
    with runlog.open_run(settings=s, tools=[pay]) as run:
        run.append(
            EventType.TOOL_CALL_STARTED,
            call_id="call-1",
            name="pay",
            args_json='{"amount":7}',
            idempotency_key="k-pay-7",
            risk="irreversible",
        )
        rid = run.run_id  # the worker dies here: STARTED without COMPLETED
    with runlog.open_run(rid, settings=s, tools=[pay]) as run:
        (ap,) = run.state.pending_approvals
        assert run.state.approvals[ap].kind == "uncertain_call"
    return rid, ap


def _pay(invoked: list[str]) -> runlog.Tool:
    def effect(args: dict[str, Any], *, idempotency_key: str) -> str:
        invoked.append(idempotency_key)
        return "paid"

    return runlog.tool("pay", risk="irreversible")(effect)


@pytest.mark.parametrize("attempt", range(3))
def test_racing_decisions_on_an_uncertain_call_run_the_tool_by_the_first_only(
    s: Settings, attempt: int
) -> None:
    invoked: list[str] = []
    pay = _pay(invoked)
    rid, ap = _escalated_call(s, pay)
    gate = threading.Barrier(2)
    outcomes: dict[bool, Any] = {}

    def decider(approved: bool) -> None:
        gate.wait()
        try:
            outcomes[approved] = runlog.decide(
                rid, ap, approved=approved, decided_by=f"ops-{approved}", settings=s, tools=[pay]
            )
        except DecisionConflict as exc:
            outcomes[approved] = exc

    threads = [threading.Thread(target=decider, args=(v,)) for v in (True, False)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    (winner,) = [v for v, o in outcomes.items() if o == "recorded"]
    (lost,) = [o for o in outcomes.values() if isinstance(o, DecisionConflict)]
    assert lost.approved is winner and lost.decided_by == f"ops-{winner}"
    assert [d for d in _decisions(s, rid) if d[2]] == [(f"ops-{winner}", winner, True)]
    # approve: retried once with the same key; reject: never executed again.
    assert invoked == (["k-pay-7"] if winner else [])
    with runlog.open_run(rid, settings=s, tools=[pay]) as run:
        assert "k-pay-7" in run.state.completed_calls
    assert invoked == (["k-pay-7"] if winner else [])


def test_a_superseded_approval_of_a_rejected_call_never_runs_it(s: Settings) -> None:
    invoked: list[str] = []
    pay = _pay(invoked)
    rid, ap = _escalated_call(s, pay)
    runlog.decide(rid, ap, approved=False, decided_by="ops-1", note="done by phone", settings=s)
    with runlog.open_run(rid, settings=s, tools=[pay], recover=False) as run:
        run.append(EventType.APPROVAL_DECIDED, approval_id=ap, approved=True, decided_by="ops-2")
    with runlog.open_run(rid, settings=s, tools=[pay]) as run:
        assert "done by phone" in run.state.completed_calls["k-pay-7"]
    assert invoked == []
