"""The event vocabulary (``runlog.schemas._vocabulary``) and its exhaustive classification.

* Every type is state-changing or record-only, never both and never neither.
* A type in neither set raises ``UnknownEventType`` naming it, in ``classify`` and in
  ``parse_event_type``: a new member cannot disappear because a branch was forgotten.
* ``parse_event_type`` takes a member's wire value exactly and nothing else (not its
  Python name, another case, surrounding space): ``UnknownEventType``, a ``SchemaError``,
  naming the value.
* The first event of a run is a start or a fork's lineage record; the events that move
  ownership are those and a takeover; all of them are state-changing.

The fold's rule for every type: tests/schemas/test_codec.py.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runlog.errors import SchemaError, UnknownEventType
from runlog.schemas import _vocabulary as vocabulary
from runlog.schemas._vocabulary import (
    OWNERSHIP,
    RECORD_ONLY,
    STARTS,
    STATE_CHANGING,
    EventType,
    classify,
    parse_event_type,
)

VALUES = {et.value for et in EventType}


def test_every_type_is_state_changing_or_record_only_exactly_once() -> None:
    assert not STATE_CHANGING & RECORD_ONLY
    assert set(EventType) == STATE_CHANGING | RECORD_ONLY
    for et in EventType:
        assert classify(et) == ("state" if et in STATE_CHANGING else "record")
        assert parse_event_type(et.value) is et
        # The member is its wire value (a str), as JSON and the envelope carry it.
        assert json.dumps(et) == json.dumps(et.value)


def test_a_type_in_neither_set_raises_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A member added to the vocabulary but to neither set (simulated by taking one out)."""
    forgotten = EventType.MEMORY_WRITTEN
    monkeypatch.setattr(vocabulary, "RECORD_ONLY", RECORD_ONLY - {forgotten})
    for call in (lambda: classify(forgotten), lambda: parse_event_type(forgotten.value)):
        with pytest.raises(UnknownEventType) as err:
            call()
        assert "'memory_written'" in str(err.value)
    assert classify(EventType.GUARDRAIL_TRIGGERED) == "record"  # the others still classify


@pytest.mark.parametrize(
    "value",
    ["RUN_STARTED", "Run_Started", " run_started", "run_started\n", "run-started", "", "run"],
)
def test_only_a_members_exact_value_parses(value: str) -> None:
    with pytest.raises(UnknownEventType) as err:
        parse_event_type(value)
    assert isinstance(err.value, SchemaError)
    assert repr(value) in str(err.value)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=30).filter(lambda v: v not in VALUES))
def test_any_other_text_is_refused_naming_it(value: str) -> None:
    with pytest.raises(UnknownEventType) as err:
        parse_event_type(value)
    assert repr(value) in str(err.value)


def test_starts_and_ownership_events() -> None:
    assert {EventType.RUN_STARTED, EventType.RUN_FORKED} == STARTS
    assert STARTS | {EventType.RUN_RESUMED} == OWNERSHIP
    # The fold must see every event that starts a run or moves its ownership.
    assert OWNERSHIP <= STATE_CHANGING
