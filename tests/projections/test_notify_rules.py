"""What the notification projection owes: one notification per valid approval request,
named by one identity across the deployment, and the standing decision that settles it.

Pure: events built in memory (``codec_support.make_event``) and folded with the writers'
rule; the delivery (Redis, the webhook) is tests/consumers/test_notify.py's.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from codec_support import make_event
from hypothesis import given
from hypothesis import strategies as st

from runlog.projections._notify import decided, identity, requested
from runlog.projections._run_state import RunState, accept
from runlog.schemas._models import Event
from runlog.schemas._vocabulary import EventType

T0 = datetime(2020, 1, 1, tzinfo=UTC)


def at(t: float) -> datetime:
    return T0 + timedelta(seconds=t)


class Run:
    """A run's log folded as it is written (event n at n seconds after T0)."""

    def __init__(self) -> None:
        self.seq, self.epoch = 0, 1
        self.state = RunState()
        self.add(EventType.RUN_STARTED, agent="a", goal="g")

    def add(self, et: EventType, **payload: Any) -> Event:
        self.seq += 1
        return self.write(et, seq=self.seq, epoch=self.epoch, **payload)

    def write(self, et: EventType, *, seq: int, epoch: int, **payload: Any) -> Event:
        ev = make_event(
            et,
            payload,
            run_id="r1",
            tenant="acme",
            seq=seq,
            epoch=epoch,
            writer_id=f"w{epoch}",
            occurred_at=at(seq),
        )
        accept(self.state, ev)
        return ev

    def ask(self, approval_id: str, **payload: Any) -> Event:
        return self.add(
            EventType.APPROVAL_REQUESTED,
            approval_id=approval_id,
            **{"kind": "action", "reason": "refund 700?", **payload},
        )

    def decide(self, approval_id: str, approved: bool, by: str) -> Event:
        return self.add(
            EventType.APPROVAL_DECIDED, approval_id=approval_id, approved=approved, decided_by=by
        )


# A tenant holds no ":" and a run id no "/" (schemas._keys); an approval id holds anything.
tenants = st.text(alphabet="ab/@.-_", min_size=1, max_size=6)
run_ids = st.text(alphabet="ab:@.-_", min_size=1, max_size=6)
approval_ids = st.text(alphabet="ab:/@", max_size=6)


@given(tenant=tenants, run_id=run_ids, approval_id=approval_ids)
def test_an_identity_names_one_request_and_only_one(
    tenant: str, run_id: str, approval_id: str
) -> None:
    """Unambiguous: the tenant, run and approval read back from the identity alone."""
    ident = identity(tenant, run_id, approval_id)
    assert ident.startswith("runlog:")
    rest = ident.removeprefix("runlog:")
    got_tenant, _, rest = rest.partition(":")
    got_run, _, got_approval = rest.partition("/")
    assert (got_tenant, got_run, got_approval) == (tenant, run_id, approval_id)


def test_a_valid_request_owes_one_notification_holding_what_a_person_needs() -> None:
    run = Run()
    due = at(3600)
    ev = run.ask("ap1", name="refund", idempotency_key="k1", due_at=due)
    assert requested(run.state, ev) == {
        "id": identity("acme", "r1", "ap1"),
        "tenant": "acme",
        "run_id": "r1",
        "approval_id": "ap1",
        "kind": "action",
        "reason": "refund 700?",
        "tool": "refund",
        "idempotency_key": "k1",
        "requested_at": at(ev.seq).isoformat(),
        "requested_by": "w1",
        "requested_seq": ev.seq,
        "due_at": due.isoformat(),
    }
    no_deadline = requested(run.state, run.ask("ap2"))
    assert no_deadline is not None and no_deadline["due_at"] is None
    # Anything but a request owes nothing; a decision settles instead.
    assert requested(run.state, run.add(EventType.USER_MESSAGE, content="hi")) is None
    assert requested(run.state, run.decide("ap1", True, "ann")) is None


def test_a_fenced_request_or_decision_neither_asks_nor_settles() -> None:
    run = Run()
    run.ask("ap1")
    run.epoch = 2
    run.add(EventType.RUN_RESUMED, previous_epoch=1, expected_prev_seq=run.seq)
    # The old owner's late writes: excluded from the run, so nobody is asked or answered.
    stale_ask = run.write(
        EventType.APPROVAL_REQUESTED,
        seq=run.seq + 1,
        epoch=1,
        approval_id="ap-stale",
        kind="action",
        reason="r",
    )
    stale_answer = run.write(
        EventType.APPROVAL_DECIDED,
        seq=run.seq + 1,
        epoch=1,
        approval_id="ap1",
        approved=True,
        decided_by="ann",
    )
    assert run.state.fenced_writes == 2
    assert requested(run.state, stale_ask) is None
    assert decided(run.state, stale_answer) is None, "ap1 still waits for a person"
    assert run.state.pending_approvals.keys() == {"ap1"}


def test_the_first_decision_settles_the_request_and_a_later_one_names_it() -> None:
    run = Run()
    ask = run.ask("ap1")
    assert decided(run.state, ask) is None, "a request settles nothing"
    first = run.decide("ap1", True, "ann")
    settled = decided(run.state, first)
    assert settled is not None
    ident, how = settled
    assert ident == identity("acme", "r1", "ap1")
    assert how == {"approved": True, "decided_by": "ann", "decided_at": at(first.seq).isoformat()}
    # A race let a second decision in: the request stays settled the first way.
    later = run.decide("ap1", False, "bob")
    again = decided(run.state, later)
    assert again is not None and again[0] == ident
    assert (again[1]["approved"], again[1]["decided_by"]) == (True, "ann")
    # A decision of a request this run never made settles nothing.
    assert decided(run.state, run.decide("ap-unknown", True, "ann")) is None


def test_a_repeated_request_id_owes_no_second_notification() -> None:
    """``requested``: "not this request (the fold keeps the first of a repeated id)"; and
    the person's decision on the first stays final."""
    run = Run()
    first = run.ask("ap1")
    assert requested(run.state, first) is not None
    run.decide("ap1", False, "ann")
    repeat = run.ask("ap1", reason="once more")
    assert requested(run.state, repeat) is None
    approval = run.state.approvals["ap1"]
    assert approval.requested_seq == first.seq and approval.approved is False
