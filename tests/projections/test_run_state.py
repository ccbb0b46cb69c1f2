"""The run-state fold: deterministic, and the ownership rule every reader shares.

Pure: events are built in memory (and once through the codec's bytes); no Kafka, no Redis.
"""

from __future__ import annotations

import base64
import copy
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from codec_support import make_event

from runlog.projections._run_state import RunState, accept, accepted_in_order, apply, fold, is_valid
from runlog.schemas import _codec as codec
from runlog.schemas._models import Event
from runlog.schemas._vocabulary import EventType

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


class Log:
    """Builds a run's log the way writers would, and lets a test forge bad writes."""

    def __init__(self, run_id: str = "run-1", tenant: str = "acme") -> None:
        self.run_id, self.tenant = run_id, tenant
        self.seq, self.epoch = 0, 1
        self.events: list[Event] = []

    def add(
        self,
        et: EventType,
        *,
        seq: int | None = None,
        epoch: int | None = None,
        tenant: str | None = None,
        run_id: str | None = None,
        **payload: Any,
    ) -> Event:
        """Append the next event (or a forged one when seq/epoch/tenant/run_id are given)."""
        forged = seq is not None or epoch is not None or tenant or run_id
        writer_epoch = self.epoch if epoch is None else epoch
        ev = make_event(
            et,
            payload,
            run_id=run_id or self.run_id,
            seq=self.seq + 1 if seq is None else seq,
            epoch=writer_epoch,
            tenant=tenant or self.tenant,
            writer_id=f"w{writer_epoch}",
        )
        if not forged:
            self.seq = ev.seq
        self.events.append(ev)
        return ev

    def start(self) -> Log:
        self.add(EventType.RUN_STARTED, agent="a", goal="g")
        return self

    def resume(self, *, epoch: int | None = None, expected: int | None = None) -> Event:
        new_epoch = self.epoch + 1 if epoch is None else epoch
        ev = self.add(
            EventType.RUN_RESUMED,
            epoch=new_epoch,
            previous_epoch=self.epoch,
            expected_prev_seq=self.seq if expected is None else expected,
            reason="takeover",
        )
        if expected is None and epoch is None:
            self.epoch, self.seq = new_epoch, ev.seq
        return ev

    def user(self, text: str = "hi", **forge: Any) -> Event:
        return self.add(EventType.USER_MESSAGE, content=text, **forge)

    def completed(self, started: Event, content: str, **payload: Any) -> Event:
        """The outcome of the call ``started`` began (its call id, name and seq)."""
        call: Any = started.payload
        return self.add(
            EventType.TOOL_CALL_COMPLETED,
            call_id=call.call_id,
            name=call.name,
            started_seq=started.seq,
            content=content,
            **payload,
        )


def _verdicts(events: list[Event]) -> list[bool]:
    st, out = RunState(), []
    for ev in events:
        out.append(is_valid(st, ev))
        apply(st, ev)
    return out


def rich_log() -> Log:
    """Every event type, tool calls settled every way, a takeover and a finish."""
    log = Log().start()
    log.user("refund order 42")
    call = {"call_id": "c1", "name": "charge", "args_json": '{"amount":7}'}
    log.add(
        EventType.MODEL_TURN,
        text="charging",
        tool_calls=[{**call, "idempotency_key": "k1"}],
        usage={"input_tokens": 10, "output_tokens": 3},
        cost_usd=0.01,
    )
    log.add(EventType.GUARDRAIL_TRIGGERED, guardrail="pii", severity="low", action="logged")
    s1 = log.add(EventType.TOOL_CALL_STARTED, **call, idempotency_key="k1", risk="irreversible")
    log.completed(s1, "charged 7", idempotency_key="k1")
    s2 = log.add(EventType.TOOL_CALL_STARTED, **call, idempotency_key="k2", risk="irreversible")
    log.resume()
    log.add(
        EventType.TOOL_CALL_UNCERTAIN,
        started_seq=s2.seq,
        call_id="c1",
        name="charge",
        idempotency_key="k2",
        error="never completed",
        detected_by="recovery",
    )
    log.add(
        EventType.RECONCILIATION_ATTEMPTED,
        started_seq=s2.seq,
        idempotency_key="k2",
        name="charge",
        outcome="no_reconciler",
        rule="irreversible",
        action="escalate",
    )
    log.add(
        EventType.APPROVAL_REQUESTED,
        approval_id="ap1",
        kind="uncertain_call",
        reason="may have run",
        idempotency_key="k2",
    )
    log.add(EventType.APPROVAL_DECIDED, approval_id="ap1", approved=False, decided_by="ops")
    log.completed(s2, "resolved by ops", idempotency_key="k2", source="reconciliation")
    s3 = log.add(
        EventType.TOOL_CALL_STARTED,
        call_id="c2",
        name="lookup",
        args_json="{}",
        idempotency_key="k3",
    )
    log.completed(s3, "no such order", is_error=True)
    log.add(EventType.TOOL_CALL_DENIED, call_id="c3", name="wire", args_json="{}", reason="no")
    log.add(EventType.CONTEXT_COMPACTED, summary="refund pending", kept_messages=2, dropped=3)
    log.add(EventType.MEMORY_WRITTEN, key="k", value="v")
    log.add(EventType.TIMER_STARTED, timer=0, seconds=5.0, due_at=datetime(2026, 1, 1, tzinfo=UTC))
    log.user("stale", epoch=1, seq=log.seq + 1)  # the old owner's late write
    log.add(EventType.RUN_CANCEL_REQUESTED, requested_by="ops", reason="refund done by hand")
    log.add(EventType.RUN_FINISHED, outcome="cancelled", summary="cancelled by ops")
    return log


def test_the_rich_log_uses_every_event_type() -> None:
    # A fork's two records need a fork (tests/projections/test_lineage.py folds them).
    forks = {EventType.RUN_FORKED, EventType.FORK_EFFECT_RESOLVED}
    # An erasure rewrites the content this log's tests read (tests/schemas/test_evolution.py
    # and tests/erasure fold it).
    erased = {EventType.CONTENT_ERASED}
    assert {ev.type for ev in rich_log().events} == set(EventType) - forks - erased


def test_folding_the_same_log_twice_gives_identical_state() -> None:
    events = rich_log().events
    a, b = fold(events), fold(events)
    assert a is not b and a.messages is not b.messages
    assert a.to_dict() == b.to_dict() and a.digest() == b.digest()
    # Through the codec's bytes and back: the same state again.
    c = fold([codec.decode(codec.encode(ev)) for ev in events])
    assert c.digest() == a.digest()
    # And the fold means something: the facts the log states are in the state.
    assert a.status == "finished" and a.outcome == "cancelled" and a.epoch == 2
    assert a.cancel is not None and a.cancel.requested_by == "ops"
    assert a.completed_calls == {"k1": "charged 7", "k2": "resolved by ops"}
    assert not a.open_calls and a.fenced_writes == 1 and a.resumptions == 1
    assert a.turns == 1 and a.compactions == 1 and a.denials == 1
    # State after each prefix is also reproducible (what a resumed writer relies on).
    for n in range(1, len(events) + 1):
        assert fold(events[:n]).digest() == fold(events[:n]).digest()


def test_fold_is_deterministic_on_the_permanent_v1_fixture() -> None:
    lines = (FIXTURES / "v1" / "log.jsonl").read_text().splitlines()
    events = [codec.decode(base64.b64decode(json.loads(line)["value_b64"])) for line in lines]
    assert len(events) == json.loads((FIXTURES / "v1" / "meta.json").read_text())["records"]
    assert fold(events).digest() == fold(events).digest()
    assert fold(events).fenced_writes >= 1  # the fixture carries a fenced write


def test_stale_epoch_after_a_resumption_is_excluded_and_counted() -> None:
    log = Log().start()
    log.user("one")
    log.resume()
    stale = log.user("from the paused owner", epoch=1, seq=log.seq + 1)
    fresh = log.user("from the new owner")
    st = fold(log.events)
    assert _verdicts(log.events) == [True, True, True, False, True]
    assert st.fenced_writes == 1 and st.seq == fresh.seq == stale.seq and st.epoch == 2
    assert [m.content for m in st.messages] == ["one", "from the new owner"]
    assert st.max_epoch_seen == 2


def test_duplicate_seq_is_excluded() -> None:
    log = Log().start()
    first = log.user("first")
    log.user("duplicate", seq=first.seq)
    log.user("next")
    st = fold(log.events)
    assert _verdicts(log.events) == [True, True, False, True]
    assert st.fenced_writes == 1 and [m.content for m in st.messages] == ["first", "next"]


def test_resumption_with_the_wrong_expected_previous_seq_is_excluded() -> None:
    log = Log().start()
    log.user("one")
    log.user("two")
    log.resume(expected=2)  # replayed a shorter prefix: its claim must not count
    log.resume(epoch=1)  # not above the current epoch: no takeover either
    log.user("three")  # the owner of epoch 1 is still the owner
    st = fold(log.events)
    assert _verdicts(log.events) == [True, True, True, False, False, True]
    assert st.epoch == 1 and st.resumptions == 0 and st.fenced_writes == 2
    assert st.seq == 4 and st.max_epoch_seen == 2  # the floor still sees the failed claim


def test_nothing_after_run_finished_counts() -> None:
    log = Log().start()
    log.add(EventType.RUN_FINISHED, outcome="succeeded")
    log.user("late")
    log.resume()
    log.add(EventType.RUN_FINISHED, outcome="failed", epoch=2, seq=log.seq + 1)
    st = fold(log.events)
    assert _verdicts(log.events) == [True, True, False, False, False]
    assert st.status == "finished" and st.outcome == "succeeded" and st.seq == 2
    assert st.fenced_writes == 3 and not st.messages


def test_an_event_of_another_tenant_or_run_with_the_same_key_is_excluded() -> None:
    log = Log(tenant="acme").start()
    log.user("ours")
    log.user("theirs", tenant="globex", seq=log.seq + 1)
    log.user("other run", run_id="run-2", seq=log.seq + 1)
    log.user("ours again")
    st = fold(log.events)
    assert _verdicts(log.events) == [True, True, False, False, True]
    assert [m.content for m in st.messages] == ["ours", "ours again"] and st.tenant == "acme"


def test_a_run_starts_only_with_run_started_at_seq_one() -> None:
    log = Log()
    log.user("before the start", seq=1)
    log.add(EventType.RUN_STARTED, seq=2, agent="a")
    log.start()
    log.add(EventType.RUN_STARTED, agent="again")
    st = fold(log.events)
    assert _verdicts(log.events) == [False, False, True, False]
    assert st.seq == 1 and st.status == "running" and st.fenced_writes == 3


@pytest.mark.parametrize("epoch", [1, 7])
def test_a_takeover_turns_open_calls_uncertain(epoch: int) -> None:
    log = Log().start()
    log.add(
        EventType.TOOL_CALL_STARTED, call_id="c", name="charge", args_json="{}", idempotency_key="k"
    )
    assert fold(log.events).open_calls["k"].status == "started"
    log.resume(epoch=epoch + 1)
    st = fold(log.events)
    assert st.open_calls["k"].status == "uncertain" and st.epoch == epoch + 1


def test_run_state_exposes_the_public_api_names() -> None:
    """The writers issue names Run.state's fields; acceptance tests outside use them."""
    from runlog.projections._run_state import RunState

    st = RunState(cost_usd=0.25, input_tokens=3, output_tokens=4)
    for name in (
        "seq",
        "turns",
        "messages",
        "usage",
        "cost",
        "completed_calls",
        "uncertain_calls",
        "compactions",
        "status",
        "outcome",
    ):
        assert hasattr(st, name), name
    assert st.cost == 0.25
    assert (st.usage.input_tokens, st.usage.output_tokens) == (3, 4)


def _settlement(log: Log, *, operator: str | None = "ops") -> Event:
    """A person's (or, ``operator=None``, a worker's) claim of a finished run."""
    ev = log.add(
        EventType.RUN_RESUMED,
        epoch=log.epoch + 1,
        previous_epoch=log.epoch,
        expected_prev_seq=log.seq,
        reason="reconcile by ops",
        operator=operator,
    )
    return ev


def _terminated_with_an_open_call() -> tuple[Log, Event]:
    log = Log().start()
    started = log.add(
        EventType.TOOL_CALL_STARTED,
        call_id="c",
        name="refund",
        args_json="{}",
        idempotency_key="k",
        risk="irreversible",
    )
    log.resume()  # terminate's takeover
    log.add(EventType.RUN_FINISHED, outcome="terminated")
    return log, started


def test_a_finished_runs_open_call_is_settled_after_the_finish_by_a_persons_claim() -> None:
    log, started = _terminated_with_an_open_call()
    claim = _settlement(log)
    assert is_valid(fold(log.events[:-1]), claim)
    log.epoch, log.seq = claim.epoch, claim.seq
    log.add(
        EventType.RECONCILIATION_ATTEMPTED,
        started_seq=started.seq,
        idempotency_key="k",
        name="refund",
        outcome="match",
        evidence="refunded",
        rule="lookup",
        action="complete",
    )
    log.completed(started, "refunded", idempotency_key="k", source="reconciliation")
    st = fold(log.events)
    assert st.fenced_writes == 0
    assert (st.status, st.outcome) == ("finished", "terminated")
    assert st.completed_calls == {"k": "refunded"} and not st.open_calls
    assert st.settling_epoch == claim.epoch and st.resumptions == 1  # terminate's alone


def test_after_a_finish_only_the_settlement_of_an_open_call_counts() -> None:
    # A worker's claim (no operator) of a finished run: refused.
    log, _ = _terminated_with_an_open_call()
    _settlement(log, operator=None)
    assert fold(log.events).fenced_writes == 1
    # At the settling epoch: a new call, a live completion, another key, a message: refused.
    log, started = _terminated_with_an_open_call()
    claim = _settlement(log)
    log.epoch, log.seq = claim.epoch, claim.seq
    for forged in (
        lambda: log.add(
            EventType.TOOL_CALL_STARTED,
            seq=log.seq + 1,
            call_id="c2",
            name="refund",
            args_json="{}",
            idempotency_key="k2",
        ),
        lambda: log.completed(started, "x", idempotency_key="k", seq=log.seq + 1),
        lambda: log.completed(
            started, "x", idempotency_key="other", source="reconciliation", seq=log.seq + 1
        ),
        lambda: log.user("late", seq=log.seq + 1),
    ):
        forged()
    # A settlement record under the terminator's epoch (not the settling one): refused.
    log.completed(started, "x", idempotency_key="k", source="reconciliation", epoch=claim.epoch - 1)
    st = fold(log.events)
    assert st.fenced_writes == 5 and "k" in st.open_calls and st.seq == claim.seq
    # A finished run with no open call cannot be claimed at all.
    done = Log().start()
    done.add(EventType.RUN_FINISHED, outcome="succeeded")
    _settlement(done)
    assert fold(done.events).fenced_writes == 1


def test_accepted_in_order_never_promises_what_accept_refuses() -> None:
    """``accepted_in_order`` lets a writer fold its own records into its confirmed view
    without a copy: wherever it says yes, ``accept`` accepts every event of the chain, over
    every stretch of a log with every event type, a takeover, forged writes and a finish."""
    log = rich_log()
    log.user("stale", epoch=1)  # a fenced write after the takeover
    log.user("after")
    events = log.events
    said_yes = 0
    for i in range(len(events)):
        for j in range(i + 1, min(len(events), i + 6) + 1):
            st = RunState()
            for ev in events[:i]:
                accept(st, ev)
            chain = events[i:j]
            if accepted_in_order(copy.deepcopy(st), chain):
                said_yes += 1
                assert all(accept(st, ev) for ev in chain), (i, j)
    assert said_yes > 0
    plain = Log().start()
    st = RunState()
    accept(st, plain.events[0])
    mine = [plain.user(f"m{k}") for k in range(3)]
    assert accepted_in_order(st, mine)
    assert not accepted_in_order(st, [mine[1], mine[0]]), "out of order"
    assert not accepted_in_order(st, [*mine[:1], plain.user("forged", epoch=7)])
