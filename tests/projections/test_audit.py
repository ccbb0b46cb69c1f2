"""The audit projection: one entry per fact the module docstring lists, each at the event's
own time and place; fenced and forged records named as such; a rebuild, or a restart from
the stored per-run state, yields the same list.

Pure: events built in memory (``codec_support.make_event``) and synthetic logs
(``replay_support.synthetic_log``); no Kafka, no Redis.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

from codec_support import make_event
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from replay_support import OPS, synthetic_log

from runlog.projections._audit import AuditRun, Entry, apply_event, entries, quarantined_entry
from runlog.projections._run_state import advance
from runlog.schemas._models import Event
from runlog.schemas._vocabulary import EventType

T0 = datetime(2020, 1, 1, tzinfo=UTC)  # long past: an entry stamped by a clock would differ
PARTITION = 4


class Run:
    """A run's log as its owners append it; event n at ``t`` (default n) seconds after T0."""

    def __init__(self) -> None:
        self.seq, self.epoch = 0, 1
        self.events: list[Event] = []
        self.add(EventType.RUN_STARTED, agent="a", goal="g")

    def add(self, et: EventType, *, t: float | None = None, **payload: Any) -> Event:
        self.seq += 1
        return self.write(et, seq=self.seq, epoch=self.epoch, t=t, **payload)

    def write(
        self, et: EventType, *, seq: int, epoch: int, t: float | None = None, **payload: Any
    ) -> Event:
        """Any record, valid or not (a stale owner's, when ``epoch`` is an old one)."""
        when = T0 + timedelta(seconds=seq if t is None else t)
        ev = make_event(
            et,
            payload,
            run_id="r1",
            tenant="acme",
            seq=seq,
            epoch=epoch,
            writer_id=f"w{epoch}",
            occurred_at=when,
        )
        self.events.append(ev)
        return ev

    def take(self, operator: str | None = None) -> Event:
        """A takeover: a worker resuming the run, or a person taking it (``operator``)."""
        self.epoch += 1
        return self.add(
            EventType.RUN_RESUMED,
            previous_epoch=self.epoch - 1,
            expected_prev_seq=self.seq,
            reason="takeover",
            operator=operator,
        )


def audit(events: list[Event], run: AuditRun | None = None) -> list[Entry]:
    run = AuditRun() if run is None else run
    return [e for i, ev in enumerate(events) for e in apply_event(run, ev, PARTITION, 1000 + i)]


CALL: dict[str, Any] = {
    "call_id": "c1",
    "name": "charge",
    "args_json": "{}",
    "idempotency_key": "k1",
}


def test_each_fact_of_the_run_is_one_entry_at_its_events_time_and_place() -> None:
    run = Run()
    run.add(EventType.USER_MESSAGE, content="refund")
    run.add(EventType.MODEL_TURN, text="ok")
    first = run.add(EventType.TOOL_CALL_STARTED, **CALL)  # a first attempt: no entry
    run.add(
        EventType.TOOL_CALL_COMPLETED,
        call_id="c1",
        name="charge",
        started_seq=first.seq,
        content="timeout",
        is_error=True,
    )
    retry = run.add(EventType.TOOL_CALL_STARTED, **CALL, attempt=2)
    run.add(EventType.TOOL_CALL_DENIED, call_id="c2", name="wire", args_json="{}", reason="no")
    run.add(EventType.GUARDRAIL_TRIGGERED, guardrail="pii", severity="low", action="logged")
    run.add(EventType.MEMORY_WRITTEN, key="k", value="v")
    run.add(EventType.CONTEXT_COMPACTED, summary="s", kept_messages=1, dropped=2)
    run.add(EventType.APPROVAL_REQUESTED, t=100, approval_id="ap1", kind="action", reason="big")
    run.add(EventType.APPROVAL_DECIDED, t=102.5, approval_id="ap1", approved=True, decided_by="ann")
    run.take()
    run.add(
        EventType.TOOL_CALL_UNCERTAIN,
        started_seq=retry.seq,
        call_id="c1",
        name="charge",
        idempotency_key="k1",
        error="lost",
        detected_by="recovery",
    )
    run.add(
        EventType.RECONCILIATION_ATTEMPTED,
        started_seq=retry.seq,
        idempotency_key="k1",
        name="charge",
        outcome="unavailable",
        rule="lookup",
        action="keep_uncertain",
    )
    run.take(operator="ops")
    run.add(EventType.RUN_CANCEL_REQUESTED, requested_by="ops", reason="enough")
    run.add(EventType.RUN_FINISHED, outcome="cancelled", summary="stopped by ops")

    got = audit(run.events)
    assert [e["kind"] for e in got] == [
        "retry",
        "denial",
        "guardrail",
        "compaction",
        "approval_requested",
        "approval_decided",
        "resumption",
        "uncertain",
        "reconciliation",
        "operator_takeover",
        "cancel_requested",
        "finished",
    ]
    by_seq = {ev.seq: (i, ev) for i, ev in enumerate(run.events)}
    for e in got:
        i, ev = by_seq[e["seq"]]
        assert (e["epoch"], e["writer"], e["partition"], e["offset"]) == (
            ev.epoch,
            ev.writer_id,
            PARTITION,
            1000 + i,
        )
        assert e["at"] == ev.occurred_at.isoformat(), "the event's own time, never a clock"
    kinds = {e["kind"]: e for e in got}
    assert (kinds["retry"]["attempt"], kinds["retry"]["idempotency_key"]) == (2, "k1")
    decided = kinds["approval_decided"]
    assert decided["latency_ms"] == 2500, "from the request to the person's decision"
    assert decided["requested_at"] == (T0 + timedelta(seconds=100)).isoformat()
    assert kinds["operator_takeover"]["operator"] == "ops"
    assert "operator" not in kinds["resumption"]
    assert kinds["finished"]["outcome"] == "cancelled"


def test_a_fenced_write_is_one_entry_naming_what_the_rule_kept() -> None:
    run = Run()
    run.add(EventType.USER_MESSAGE, content="one")
    run.take()
    stale = run.write(EventType.RUN_FINISHED, seq=run.seq + 1, epoch=1, outcome="succeeded")
    state = AuditRun()
    got = audit(run.events, state)
    assert [e["kind"] for e in got] == ["resumption", "fenced_write"]
    fenced = got[-1]
    assert fenced["type"] == "run_finished" and fenced["event_id"] == stale.event_id
    assert (fenced["seq"], fenced["epoch"]) == (stale.seq, 1)
    assert (fenced["valid_seq"], fenced["valid_epoch"]) == (3, 2)
    # Excluded from the run: it did not finish it.
    assert state.validator.status == "running" and state.validator.fenced_writes == 1


def test_a_record_its_tenants_writers_did_not_authenticate_is_named_forged() -> None:
    run = Run()
    ev = run.add(EventType.USER_MESSAGE, content="injected")
    state = AuditRun()
    audit(run.events[:1], state)
    step = advance(state.validator, ev, forged="bad mac")
    got = entries(state.validator, ev, step, PARTITION, 7)
    assert [e["kind"] for e in got] == ["forged_tenant_record"]
    assert got[0]["tenant"] == "acme" and got[0]["valid_seq"] == 1
    assert state.validator.seq == 1, "a forged record changes nothing"


def test_a_quarantined_record_is_an_entry_of_where_it_sits_and_why() -> None:
    e = quarantined_entry(3, 42, "CorruptRecord", "bad magic byte")
    assert e == {
        "kind": "quarantined",
        "partition": 3,
        "offset": 42,
        "error": "CorruptRecord",
        "message": "bad magic byte",
    }


def _restarted_at_every_cut(events: list[Event]) -> None:
    whole = audit(events)
    assert whole == audit(events), "a rebuild yields the same list"
    for cut in range(len(events) + 1):
        before = AuditRun()
        head = audit(events[:cut], before)
        # The runner restarts: its per-run state comes back from the store's JSON.
        back = AuditRun.from_dict(json.loads(json.dumps(before.to_dict())))
        tail = [
            e
            for i, ev in enumerate(events[cut:], cut)
            for e in apply_event(back, ev, PARTITION, 1000 + i)
        ]
        assert head + tail == whole, f"restarted at {cut} of {len(events)}"


def test_a_superseded_decision_names_the_standing_one_across_a_restart() -> None:
    run = Run()
    run.add(EventType.APPROVAL_REQUESTED, t=10, approval_id="ap1", kind="action", reason="r")
    run.add(EventType.APPROVAL_DECIDED, t=20, approval_id="ap1", approved=True, decided_by="ann")
    run.add(EventType.USER_MESSAGE, t=25, content="meanwhile")
    run.add(EventType.APPROVAL_DECIDED, t=30, approval_id="ap1", approved=False, decided_by="bob")
    got = audit(run.events)
    assert [e["kind"] for e in got] == [
        "approval_requested",
        "approval_decided",
        "approval_superseded",
    ]
    late = got[-1]
    assert (late["decided_by"], late["superseded_by"], late["standing_approved"]) == (
        "bob",
        "ann",
        True,
    )
    assert late["standing_at"] == (T0 + timedelta(seconds=20)).isoformat()
    _restarted_at_every_cut(run.events)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.sampled_from(OPS), max_size=30), seed=st.integers(0, 2**16))
def test_a_rebuild_or_a_restart_yields_the_same_entries(ops: list[str], seed: int) -> None:
    _restarted_at_every_cut(synthetic_log(ops, seed))
