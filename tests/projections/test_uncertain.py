"""The uncertain-call queue: a call joins it when its writer lost it, leaves it when a
valid completion closes it, and how it closed is counted; fenced writes touch nothing.

Pure: events built in memory (``codec_support.make_event``) and synthetic logs
(``replay_support.synthetic_log``); no Kafka, no Redis, no clock.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from codec_support import make_event
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from replay_support import OPS, synthetic_log

from runlog.projections._uncertain import COUNTERS, UncertainRun, apply_event
from runlog.schemas._models import ERASED, Event
from runlog.schemas._vocabulary import EventType

T0 = datetime(2020, 1, 1, tzinfo=UTC)


def at(t: float) -> str:
    return (T0 + timedelta(seconds=t)).isoformat()


class Run:
    """A run's log as its owners append it (event n at n seconds after T0), folded into
    the uncertain projection as it goes: ``add`` returns what the event changed."""

    def __init__(self) -> None:
        self.seq, self.epoch = 0, 1
        self.queue = UncertainRun()
        self.add(EventType.RUN_STARTED, agent="a", goal="g")

    def add(self, et: EventType, **payload: Any) -> dict[str, int]:
        self.seq += 1
        return self.write(et, seq=self.seq, epoch=self.epoch, **payload)

    def write(self, et: EventType, *, seq: int, epoch: int, **payload: Any) -> dict[str, int]:
        """Any record, valid or not; returns the counter increments it caused."""
        self.last = make_event(
            et,
            payload,
            run_id="r1",
            tenant="acme",
            seq=seq,
            epoch=epoch,
            occurred_at=T0 + timedelta(seconds=seq),
        )
        self.changed: set[str] = set()
        return apply_event(self.queue, self.last, self.changed)

    def start(self, key: str = "k1", attempt: int = 1) -> int:
        self.add(
            EventType.TOOL_CALL_STARTED,
            call_id="c1",
            name="charge",
            args_json='{"amount": 7}',
            idempotency_key=key,
            attempt=attempt,
            risk="irreversible",
        )
        return self.seq

    def take(self) -> dict[str, int]:
        self.epoch += 1
        return self.add(
            EventType.RUN_RESUMED, previous_epoch=self.epoch - 1, expected_prev_seq=self.seq
        )

    def lose(self, how: str, started: int, key: str = "k1") -> dict[str, int]:
        """The writer loses the call: it dies (a takeover), or it records the outcome unknown."""
        if how == "takeover":
            return self.take()
        return self.add(
            EventType.TOOL_CALL_UNCERTAIN,
            started_seq=started,
            call_id="c1",
            name="charge",
            idempotency_key=key,
            error="connection reset",
            detected_by="live",
        )

    def complete(self, started: int, content: str = "done", **payload: Any) -> dict[str, int]:
        return self.add(
            EventType.TOOL_CALL_COMPLETED,
            call_id="c1",
            name="charge",
            started_seq=started,
            content=content,
            idempotency_key="k1",
            **payload,
        )


@pytest.mark.parametrize("how", ["takeover", "uncertain"])
def test_a_call_in_flight_joins_the_queue_only_when_its_writer_loses_it(how: str) -> None:
    run = Run()
    started = run.start()
    assert run.queue.calls == {} and run.changed == set(), "in flight for a live writer"
    assert run.lose(how, started) == {"opened": 1}
    assert run.changed == {"k1"}
    call = run.queue.calls["k1"]
    assert (call.status, call.tool, call.risk, call.attempts) == (
        "uncertain",
        "charge",
        "irreversible",
        1,
    )
    assert (call.run_id, call.tenant, call.args_json) == ("r1", "acme", '{"amount": 7}')
    assert call.first_started_at == call.started_at == at(started)
    assert (call.opened_at, call.opened_seq) == (at(run.seq), run.seq)
    assert run.queue.counters == {**dict.fromkeys(COUNTERS, 0), "opened": 1}


@pytest.mark.parametrize("kind", ["reconciled", "retried", "failed", "decided"])
def test_how_a_call_left_the_queue_is_counted(kind: str) -> None:
    run = Run()
    started = run.start()
    run.take()
    if kind == "reconciled":
        closed = run.complete(started, source="reconciliation")
    elif kind == "decided":
        run.add(
            EventType.APPROVAL_REQUESTED,
            approval_id="ap1",
            kind="uncertain_call",
            reason="may have run",
            idempotency_key="k1",
        )
        run.add(EventType.APPROVAL_DECIDED, approval_id="ap1", approved=False, decided_by="ops")
        assert run.queue.calls["k1"].status == "decided"
        assert run.queue.calls["k1"].approval_id == "ap1"
        closed = run.complete(started, content="not run: rejected by ops", is_error=True)
    else:
        again = run.start(attempt=2)
        retrying = run.queue.calls["k1"]
        assert (retrying.status, retrying.attempts) == ("retrying", 2)
        assert retrying.started_at == at(again) and retrying.first_started_at == at(started)
        closed = run.complete(again, is_error=kind == "failed")
    assert closed == {kind: 1} and run.changed == {"k1"}
    assert run.queue.calls == {}
    handed = {"escalated": 1} if kind == "decided" else {}  # asking a person escalates it
    assert run.queue.counters == {**dict.fromkeys(COUNTERS, 0), "opened": 1, kind: 1, **handed}


def test_an_escalation_is_counted_once_per_call() -> None:
    run = Run()
    started = run.start()
    run.take()
    escalate = {"started_seq": started, "idempotency_key": "k1", "name": "charge", "rule": "r"}
    assert run.add(
        EventType.RECONCILIATION_ATTEMPTED, **escalate, outcome="unavailable", action="escalate"
    ) == {"escalated": 1}
    assert run.queue.calls["k1"].status == "escalated"
    run.add(EventType.RECONCILIATION_ATTEMPTED, **escalate, outcome="conflict", action="escalate")
    run.add(
        EventType.APPROVAL_REQUESTED,
        approval_id="ap1",
        kind="conflict",
        reason="two answers",
        idempotency_key="k1",
    )
    call = run.queue.calls["k1"]
    assert (call.status, call.escalated, call.reconciliations) == ("conflict", True, 2)
    assert call.last_evidence == "conflict" and call.approval_id == "ap1"
    assert run.queue.counters["escalated"] == 1


def test_fenced_writes_neither_open_nor_close_a_call() -> None:
    run = Run()
    started = run.start()
    # A would-be owner's claim on an outdated view: no takeover, so nothing is lost.
    assert (
        run.write(
            EventType.RUN_RESUMED, seq=run.seq, epoch=5, previous_epoch=1, expected_prev_seq=1
        )
        == {}
    )
    assert run.queue.calls == {} and run.changed == set()
    run.take()
    before = (run.queue.to_dict()["calls"], dict(run.queue.counters))
    # The old owner wakes up and reports the call done: a stale epoch, a seq already taken.
    stale = {"call_id": "c1", "name": "charge", "content": "done", "idempotency_key": "k1"}
    assert (
        run.write(EventType.TOOL_CALL_COMPLETED, seq=run.seq, epoch=1, started_seq=started, **stale)
        == {}
    )
    assert (run.queue.to_dict()["calls"], run.queue.counters) == before
    assert run.queue.calls["k1"].status == "uncertain" and run.changed == set()
    assert run.queue.validator.fenced_writes == 2


def test_an_erased_runs_calls_stay_queued_without_their_content() -> None:
    run = Run()
    started = run.start()
    run.lose("uncertain", started)
    run.add(
        EventType.RECONCILIATION_ATTEMPTED,
        started_seq=started,
        idempotency_key="k1",
        name="charge",
        outcome="absent",
        evidence="no charge of 7 found",
        rule="lookup",
        action="keep_uncertain",
    )
    run.add(EventType.RUN_FINISHED, outcome="failed")
    run.epoch += 1  # the person erasing takes the finished run
    erased = run.add(
        EventType.CONTENT_ERASED, subject="r1", erased_by="dpo", reason="gdpr", key_ids=["k"]
    )
    assert erased == {} and run.changed == {"k1"}
    call = run.queue.calls["k1"]
    assert (call.status, call.idempotency_key, call.tool) == ("uncertain", "k1", "charge")
    assert call.args_json == ERASED and call.last_error == ERASED
    verdict, _, rest = (call.last_evidence or "").partition(":")
    assert verdict == "absent" and rest == ERASED, "the verdict is structure, the evidence content"
    told = json.dumps(call.to_dict())
    assert "amount" not in told and "no charge" not in told and "reset" not in told


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(st.sampled_from(OPS), max_size=40),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_the_queue_holds_exactly_the_lost_calls_through_any_log_and_restart(
    ops: list[str], seed: int, data: st.DataObject
) -> None:
    events = synthetic_log(ops, seed)
    restart = data.draw(st.integers(0, len(events)))
    queue, totals = UncertainRun(), dict.fromkeys(COUNTERS, 0)
    for i, ev in enumerate(events):
        if i == restart:  # the runner restarts: the run's state comes back from its JSON
            queue = UncertainRun.from_dict(json.loads(json.dumps(queue.to_dict())))
        before = {k: c.to_dict() for k, c in queue.calls.items()}
        changed: set[str] = set()
        for name, n in apply_event(queue, ev, changed).items():
            assert n > 0
            totals[name] += n
        after = {k: c.to_dict() for k, c in queue.calls.items()}
        # What it added, changed or removed is named (the store rewrites only those).
        moved = {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
        assert moved <= changed
        open_calls = queue.validator.open_calls
        assert queue.calls.keys() <= open_calls.keys(), "a closed call left the queue"
        lost = {k for k, c in open_calls.items() if c.status != "started" or c.uncertain_recorded}
        assert lost <= queue.calls.keys(), "every call its writer lost is queued"
    assert queue.counters == totals
    assert queue.to_dict() == _folded(events).to_dict()


def _folded(events: list[Event]) -> UncertainRun:
    queue = UncertainRun()
    for ev in events:
        apply_event(queue, ev)
    return queue
