"""The state projection's fold: exactly the writers' run state, plus where the run lives in
the log (its partition, first and last offsets, records seen, records quarantined).

Pure: synthetic logs (``replay_support.synthetic_log``: takeovers, fenced writes, a finish)
are folded in memory at made-up log positions; no Kafka, no Redis.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime

from codec_support import make_event
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from replay_support import OPS, synthetic_log

from runlog.projections._run_state import RunState, accept, fold
from runlog.projections._state_view import (
    VIEW_VERSION,
    StateView,
    apply_quarantined,
    facts,
    fold_record,
    place,
)
from runlog.schemas._models import Event
from runlog.schemas._vocabulary import EventType

PARTITION = 2


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(st.sampled_from(OPS), max_size=40),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_the_view_is_the_writers_fold_plus_where_each_record_of_the_run_sits(
    ops: list[str], seed: int, data: st.DataObject
) -> None:
    events = synthetic_log(ops, seed)
    # Some records of the run do not decode: quarantined, before any of its events.
    bad = data.draw(st.lists(st.booleans(), min_size=len(events), max_size=len(events)))
    view, writers = StateView(), RunState()
    offset, seen, quarantined = 100, [], []
    for ev, undecodable in zip(events, bad, strict=True):
        if undecodable:
            apply_quarantined(view, PARTITION, offset, "CorruptRecord")
            seen.append(offset)
            quarantined.append(offset)
            offset += 1
        assert fold_record(view, ev, PARTITION, offset) is accept(writers, ev)
        seen.append(offset)
        offset += 3  # other runs' records in between
    # The run state is the writers' fold exactly: quarantined records change nothing.
    assert view.state.to_dict() == fold(events).to_dict()
    assert view.state.digest() == writers.digest()
    # Where the run lives: every record counted, valid, fenced or quarantined alike.
    assert view.records == len(seen)
    assert view.first_offset == seen[0] and view.last_offset == seen[-1]
    assert view.partition == PARTITION
    assert [(q.partition, q.offset, q.error) for q in view.quarantined] == [
        (PARTITION, o, "CorruptRecord") for o in quarantined
    ]


def test_placing_or_quarantining_a_record_moves_the_location_and_not_the_state() -> None:
    events = synthetic_log(["user", "call", "turn"], seed=1)
    view = StateView()
    for i, ev in enumerate(events):
        fold_record(view, ev, 0, 10 + i)
    before = view.state.digest()
    place(view, 0, 20)  # folded elsewhere (a shared validator): only where it sits is noted
    apply_quarantined(view, 0, 21, "SchemaNotFound")
    assert view.state.digest() == before
    assert (view.partition, view.first_offset, view.last_offset) == (0, 10, 21)
    assert view.records == len(events) + 2
    # A view whose first record is one it could not use still starts there.
    first_bad = apply_quarantined(StateView(), 1, 5, "CorruptRecord")
    assert (first_bad.partition, first_bad.first_offset, first_bad.records) == (1, 5, 1)
    assert first_bad.state == RunState()


def test_the_stored_view_reads_back_as_the_same_view() -> None:
    events = synthetic_log(["user", "call", "turn", "complete", "takeover", "fenced_stale"], 3)
    view = StateView()
    for i, ev in enumerate(events):
        fold_record(view, ev, 1, i)
    apply_quarantined(view, 1, len(events), "CorruptRecord")
    stored = json.loads(json.dumps(view.to_dict()))
    assert stored["version"] == VIEW_VERSION
    back = StateView.from_dict(stored)
    assert back.to_dict() == view.to_dict() and back.state.digest() == view.state.digest()
    # Slim: the conversation and stored results are left out (kept apart), nothing else.
    slim = view.to_dict(slim=True)
    assert view.state.messages and view.state.completed_calls
    assert slim["state"]["messages"] == [] and slim["state"]["completed_calls"] == {}
    assert {k: v for k, v in slim.items() if k != "state"} == view.location_dict()
    assert slim["state"]["seq"] == view.state.seq and slim["state"]["turns"] == view.state.turns


def _erasure(after: RunState) -> Event:
    """A person erasing the finished run's content (above its epoch, at its next seq)."""
    return make_event(
        EventType.CONTENT_ERASED,
        {"subject": "s", "erased_by": "dpo", "reason": "gdpr", "key_ids": ["k1"]},
        run_id=after.run_id,
        tenant=after.tenant,
        seq=after.seq + 1,
        epoch=after.epoch + 1,
        occurred_at=datetime(2030, 1, 2, tzinfo=UTC),
    )


def test_the_summary_is_flat_strings_and_names_an_erasure_only_once_erased() -> None:
    empty = StateView().summary()
    assert all(isinstance(v, str) for v in empty.values())
    assert empty["partition"] == empty["first_offset"] == empty["outcome"] == ""
    assert empty["last_event_at"] == "" and "erased_by" not in empty

    events = synthetic_log(["user", "turn", "call", "call", "complete", "finish"], 5)
    view = StateView()
    for i, ev in enumerate(events):
        fold_record(view, ev, 0, 40 + i)
    st = view.state
    summary = view.summary()
    assert all(isinstance(v, str) for v in summary.values())
    # Collections are reported by their size.
    assert summary["open_calls"] == str(len(st.open_calls)) == "1"
    assert summary["completed_calls"] == str(len(st.completed_calls))
    assert (summary["status"], summary["outcome"]) == ("finished", "done")
    assert (summary["partition"], summary["first_offset"]) == ("0", "40")
    assert float(summary["cost_usd"]) == st.cost_usd and summary["seq"] == str(st.seq)
    assert "erased_by" not in summary, "a run that was not erased keeps its summary as it was"

    assert fold_record(view, _erasure(st), 0, 99)
    erased = view.summary()
    assert (erased["erased_by"], erased["erasure_reason"]) == ("dpo", "gdpr")
    assert erased["erased_at"] == "2030-01-02T00:00:00+00:00"
    assert erased["outcome"] == "done" and erased["seq"] == str(st.seq)


def test_facts_names_the_fields_in_the_order_asked_and_collections_by_size() -> None:
    st = fold(synthetic_log(["user", "turn", "call", "approval"], 2))
    got = facts(st, "turns", "messages", "open_calls", "approvals", "status")
    assert list(got) == ["turns", "messages", "open_calls", "approvals", "status"]
    assert got == {
        "turns": st.turns,
        "messages": len(st.messages),
        "open_calls": len(st.open_calls),
        "approvals": len(st.approvals),
        "status": st.status,
    }
    assert got["messages"] >= 2 and got["open_calls"] == 1
