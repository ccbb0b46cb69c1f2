"""The codec against a real topic: every event type round-trips with its headers; bad bytes,
unknown schemas and invalid payloads fail loudly; tool arguments are canonical or refused
before anything is appended."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
from codec_support import make_event
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition
from workers.common import read_log, services_for

import runlog
from runlog._settings import Settings
from runlog.errors import (
    CorruptRecord,
    SchemaError,
    ToolArgumentsError,
    UnknownEventType,
    UnknownFingerprint,
    UnreadableRecord,
    ValidationFailed,
)
from runlog.log._kafka import reader_config
from runlog.log._reader import LogReader
from runlog.producers._writer import EventWriter
from runlog.projections import _run_state as run_state
from runlog.projections._lineage import pack_state
from runlog.schemas import _codec as codec
from runlog.schemas._canonical import MAX_ARGS_BYTES, canonical_json
from runlog.schemas._keys import idempotency_key, new_run_id, partition_for
from runlog.schemas._models import PAYLOAD_MODELS, Event
from runlog.schemas._vocabulary import (
    RECORD_ONLY,
    STATE_CHANGING,
    EventType,
    classify,
    parse_event_type,
)

pytestmark = pytest.mark.timeout(60)

# Values by field name; a sample payload of a type takes the ones its current model has.
FIELD_VALUES: dict[str, Any] = {
    "agent": "support-bot",
    "goal": "refund order 42",
    "labels": {"team": "payments"},
    "previous_epoch": 1,
    "expected_prev_seq": 7,
    "gap_ms": 1234,
    "reason": "resumed after a crash",
    "operator": "ann",
    "requested_by": "ann",
    "subject": "user-42",
    "erased_by": "dpo",
    "content": "charged 7 to A-1 — ünïcode ✓",
    "text": "I will charge the card.",
    "tool_calls": [
        {"call_id": "c-1", "name": "charge", "args_json": '{"amount":7}', "idempotency_key": "k1"}
    ],
    "usage": {"input_tokens": 120, "output_tokens": 30},
    "cost_usd": 0.0042,
    "call_id": "c-1",
    "name": "charge",
    "args_json": '{"acct":"A-1","amount":7}',
    "policy": "spend-limit",
    "idempotency_key": "0123456789abcdef0123456789abcdef",
    "attempt": 2,
    "risk": "irreversible",
    "operation_id": "op-9",
    "started_seq": 5,
    "is_error": False,
    "source": "reconciliation",
    "duration_ms": 87,
    "error": "TimeoutError: gateway timed out",
    "detected_by": "recovery",
    "outcome": "match",
    "evidence": "ledger entry L-1",
    "rule": "authoritative lookup found the same effect",
    "action": "complete",
    "approval_id": "ap-1",
    "kind": "conflict",
    "started_at": codec.now_utc(),
    "last_error": "TimeoutError",
    "detail": '{"found": "70"}',
    "approved": True,
    "decided_by": "ops@example",
    "note": "looks right",
    "guardrail": "pii",
    "severity": "high",
    "summary": "The user wants a refund.",
    "kept_turns": 2,
    "kept_messages": 3,
    "dropped": 4,
    "timer": 0,
    "seconds": 2.5,
    "due_at": codec.now_utc(),
    "key": "preferred_name",
    "value": "Ada",
    # a fork's records
    "parent_run_id": "r-parent",
    "at_seq": 4,
    "parent_digest": "ab" * 32,
    "forked_by": "ops@example",
    "key_scope": "r-parent",
    "ancestry": ["r-root"],
    "state": pack_state({"seq": 4}),
    "parent_effects": [
        {
            "logical_key": "k1",
            "key": "k1@r-parent",
            "run_id": "r-parent",
            "seq": 6,
            "name": "charge",
            "args_json": "{}",
            "risk": "irreversible",
            "status": "completed",
            "content": "charged",
            "compensable": True,
        }
    ],
    "input_json": '{"prompt":"again"}',
    "logical_key": "k1",
    "resolution": "repeated",
    "source_run_id": "r-parent",
    "source_seq": 6,
    "source_key": "k1",
    "repeat_key": "k1@r-fork",
}


def sample_payload(et: EventType) -> Any:
    model = PAYLOAD_MODELS[et]
    missing = [
        n for n, f in model.model_fields.items() if f.is_required() and n not in FIELD_VALUES
    ]
    assert not missing, f"add sample values for {et.value}: {missing}"
    data = {n: FIELD_VALUES[n] for n in model.model_fields if n in FIELD_VALUES}
    if et is EventType.RUN_FINISHED:
        data["outcome"] = "succeeded"
    return model.model_validate(data)


def sample_event(et: EventType, run_id: str, seq: int, epoch: int = 3) -> Event:
    return make_event(
        et,
        sample_payload(et),
        run_id=run_id,
        seq=seq,
        epoch=epoch,
        tenant="acme",
        writer_id="test:1",
    )


@pytest.fixture
def fast(test_settings: Settings) -> Iterator[Settings]:
    with services_for(test_settings):
        yield test_settings


def _consume_all(settings: Settings, partition: int, n: int) -> list[Any]:
    consumer = Consumer(reader_config(settings))
    consumer.assign([TopicPartition(settings.events_topic, partition, OFFSET_BEGINNING)])
    got: list[Any] = []
    try:
        for _ in range(100):
            for msg in consumer.consume(n - len(got), timeout=0.5):
                if msg.error() is None:
                    got.append(msg)
            if len(got) >= n:
                break
    finally:
        consumer.close()
    return got


def test_every_event_type_round_trips_through_a_real_topic_with_headers(
    fast: Settings,
) -> None:
    rid = new_run_id()
    originals = [sample_event(et, rid, seq) for seq, et in enumerate(EventType, start=1)]
    writer = EventWriter(fast)
    try:
        futures = [
            writer.send(fast.events_topic, rid.encode(), codec.encode(ev), codec.headers(ev))
            for ev in originals
        ]
        delivered = [f.result(timeout=30) for f in futures]
    finally:
        writer.close()
    partition = partition_for(rid, fast.partitions)
    assert {d.partition for d in delivered} == {partition}  # key = run id: one partition

    msgs = _consume_all(fast, partition, len(originals))
    assert len(msgs) == len(originals)
    for ev, msg in zip(originals, msgs, strict=True):
        ws = codec.registry().writer(ev.type)
        headers = dict(msg.headers())
        assert headers[codec.H_TYPE] == ev.type.value.encode()
        assert headers[codec.H_FINGERPRINT] == ws.fingerprint
        assert headers[codec.H_SEQ] == str(ev.seq).encode()
        assert headers[codec.H_EPOCH] == str(ev.epoch).encode()
        assert headers[codec.H_VERSION] == str(ws.version).encode()
        value = msg.value()
        assert value[:2] == b"\xc3\x01" and value[2:10] == ws.fingerprint
        assert codec.peek_header(value) == (ev.type, ws.version)
        assert msg.key() == rid.encode()
        back = codec.decode(value)
        assert back == ev, ev.type
        assert back.occurred_at == ev.occurred_at  # microseconds survive
    # The run's reader decodes the same events in the same order.
    assert [r.event for r in read_log(fast, rid)] == originals


def _valid_bytes() -> bytes:
    return codec.encode(sample_event(EventType.TOOL_CALL_STARTED, "r-x", 4))


@pytest.mark.parametrize(
    "mangle",
    [
        # 00 starts Confluent's framing (tests/log/test_registry.py); any other byte is bad.
        pytest.param(lambda b: b"\x01\x01" + b[2:], id="bad-magic"),
        pytest.param(lambda b: b[:7], id="truncated-header"),
        pytest.param(lambda b: b[: len(b) // 2], id="truncated-body"),
        pytest.param(lambda b: b[:10] + b"\xff" * 40, id="garbage-body"),
        pytest.param(lambda b: b[:10], id="empty-body"),
        pytest.param(lambda b: b"", id="empty"),
    ],
)
def test_corrupt_bytes_raise_corrupt_record(mangle: Any) -> None:
    with pytest.raises(CorruptRecord):
        codec.decode(mangle(_valid_bytes()))


def test_a_corrupt_record_in_the_log_stops_the_reader_naming_its_offset(fast: Settings) -> None:
    rid = new_run_id()
    with runlog.open_run(rid, settings=fast) as run:
        run.append(EventType.USER_MESSAGE, content="hello")
    writer = EventWriter(fast)
    try:
        writer.send(fast.events_topic, rid.encode(), b"\xc3\x01garbage", []).result(timeout=30)
    finally:
        writer.close()
    with LogReader(fast) as reader, pytest.raises(SchemaError) as info:
        list(reader.read(rid))
    assert isinstance(info.value, UnreadableRecord)
    assert isinstance(info.value.__cause__, CorruptRecord)
    assert f"{fast.events_topic}[" in str(info.value)


def test_unknown_fingerprint_raises() -> None:
    data = _valid_bytes()
    unknown = b"\x13\x37" * 4
    with pytest.raises(UnknownFingerprint) as info:
        codec.decode(data[:2] + unknown + data[10:])
    assert info.value.fingerprint == unknown
    assert codec.peek_header(data[:2] + unknown + data[10:]) is None


def test_invalid_payload_raises_validation_failed_naming_the_field() -> None:
    payload = {
        k: v
        for k, v in FIELD_VALUES.items()
        if k in PAYLOAD_MODELS[EventType.TOOL_CALL_STARTED].model_fields and k != "idempotency_key"
    }
    with pytest.raises(ValidationFailed, match="idempotency_key"):
        codec.make_payload(EventType.TOOL_CALL_STARTED, payload)
    with pytest.raises(ValidationFailed, match="attempt"):
        codec.make_payload(
            EventType.TOOL_CALL_STARTED,
            {**payload, "idempotency_key": "k", "attempt": "twice"},
        )

    # A record that fits its Avro schema but not the model: refused on decode, by field.
    ev = sample_event(EventType.TOOL_CALL_STARTED, "r-x", 4)
    bad = ev.model_copy(update={"payload": ev.payload.model_copy(update={"risk": "catastrophic"})})
    with pytest.raises(ValidationFailed, match="risk"):
        codec.decode(codec.encode(bad))


def test_every_event_type_is_classified_exactly_once_and_has_a_fold_rule(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for et in EventType:
        assert (et in STATE_CHANGING) != (et in RECORD_ONLY), et
        assert classify(et) == ("state" if et in STATE_CHANGING else "record")
        assert parse_event_type(et.value) is et
        rule = run_state.RULES[et]
        assert (rule is run_state._record_only) == (et in RECORD_ONLY), et
        assert et in PAYLOAD_MODELS and codec.registry().current[et] >= 1
    with pytest.raises(UnknownEventType):
        parse_event_type("tool_call_teleported")

    # A type whose fold rule went missing raises instead of silently folding to nothing.
    st = run_state.fold([sample_event(EventType.RUN_STARTED, "r-x", 1, epoch=1)])
    monkeypatch.delitem(run_state.RULES, EventType.MEMORY_WRITTEN)
    with pytest.raises(UnknownEventType):
        run_state.apply(st, sample_event(EventType.MEMORY_WRITTEN, "r-x", 2, epoch=1))


def test_canonical_arguments_make_key_order_irrelevant() -> None:
    a = {"amount": 10, "acct": "x", "meta": {"b": [1, {"y": 2, "x": 1}], "a": None}}
    b = {"meta": {"a": None, "b": [1, {"x": 1, "y": 2}]}, "acct": "x", "amount": 10}
    assert (
        canonical_json(a)
        == canonical_json(b)
        == ('{"acct":"x","amount":10,"meta":{"a":null,"b":[1,{"x":1,"y":2}]}}')
    )
    key = idempotency_key("acme", "run-1", "charge", canonical_json(a), 0)
    assert key == idempotency_key("acme", "run-1", "charge", canonical_json(b), 0)
    # Everything else that identifies the action does change the key.
    others = {
        idempotency_key("other", "run-1", "charge", canonical_json(a), 0),
        idempotency_key("acme", "run-2", "charge", canonical_json(a), 0),
        idempotency_key("acme", "run-1", "refund", canonical_json(a), 0),
        idempotency_key("acme", "run-1", "charge", canonical_json({**a, "amount": 11}), 0),
        idempotency_key("acme", "run-1", "charge", canonical_json(a), 1),
    }
    assert key not in others and len(others) == 5
    # List order is meaning, not incidental: it is kept.
    assert canonical_json({"l": [1, 2]}) != canonical_json({"l": [2, 1]})


class _Obj:
    pass


@pytest.mark.parametrize(
    "args",
    [
        pytest.param({"ids": {1, 2}}, id="set"),
        pytest.param({"amount": math.nan}, id="nan"),
        pytest.param({"amount": math.inf}, id="inf"),
        pytest.param({"who": _Obj()}, id="object"),
        pytest.param({"blob": "x" * (MAX_ARGS_BYTES + 1)}, id="over-limit"),
    ],
)
def test_bad_arguments_are_refused_before_any_started_is_appended(
    args: dict[str, Any], fast: Settings
) -> None:
    calls: list[str] = []

    @runlog.tool("charge", risk="irreversible")
    def charge(a: dict[str, Any], *, idempotency_key: str) -> str:
        calls.append(idempotency_key)
        return "charged"

    with runlog.open_run(settings=fast, tools=[charge]) as run:
        seq = run.state.seq
        with pytest.raises(ToolArgumentsError):
            run.call_tool("charge", args)
        with pytest.raises(ToolArgumentsError):
            run.key_for("charge", args)
        assert run.state.seq == seq and not run.state.open_calls
        # The refusal consumed nothing: the next good call is the first occurrence.
        expected = run.key_for("charge", {"amount": 7})
        assert run.call_tool("charge", {"amount": 7}) == "charged"
    assert calls == [expected]
    types = [r.event.type for r in read_log(fast, run.run_id)]
    assert types.count(EventType.TOOL_CALL_STARTED) == 1
    assert types[:2] == [EventType.RUN_STARTED, EventType.TOOL_CALL_STARTED]
