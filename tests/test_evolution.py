"""Schema evolution: compatible steps, upcasters, loud failures where the reader must not guess."""

from __future__ import annotations

import copy
import io
import json
from importlib import resources

import fastavro
import pytest
from replay_support import load_fixture, synthetic_log

from runlog.errors import MissingUpcaster, NewerSchemaVersion, UnknownFingerprint
from runlog.projections.run_state import FOLD_VERSION, RunState, apply
from runlog.schemas import codec, evolution
from runlog.schemas.models import ApprovalDecided, ContextCompacted, ModelTurn, ToolCallCompleted
from runlog.schemas.registry import fingerprint_of, registry
from runlog.schemas.vocabulary import EventType

CC = EventType.CONTEXT_COMPACTED
TCC = EventType.TOOL_CALL_COMPLETED
MT = EventType.MODEL_TURN
AD = EventType.APPROVAL_DECIDED


def _v1(fx_type: str) -> bytes:
    fx = load_fixture("v1")
    return next(r.value for r in fx.records if r.type == fx_type)


def test_released_v1_schemas_never_changed() -> None:
    """The v1 fixture's fingerprints are exactly today's v1 .avsc files."""
    fx = load_fixture("v1")
    for r in fx.records:
        ws = codec.writer_schema_of(r.value)
        assert ws.version == 1
        root = resources.files("runlog.schemas").joinpath("avro", r.type, "v1.avsc")
        assert fingerprint_of(fastavro.parse_schema(json.loads(root.read_text()))) == r.value[2:10]


def test_current_versions() -> None:
    assert registry().current[CC] == 2
    assert registry().current[TCC] == 2
    assert registry().current[MT] == 2
    assert registry().current[AD] == 2
    assert FOLD_VERSION == 4


def test_v1_decision_resolves_as_unsigned() -> None:
    ev = codec.decode(_v1("approval_decided"))
    assert isinstance(ev.payload, ApprovalDecided) and ev.schema_version == 2
    assert (ev.payload.decided_at, ev.payload.key_id, ev.payload.signature) == (None, None, None)
    assert ev.payload.decided_by  # the v1 fields are kept as written


def test_v2_decision_keeps_its_signature() -> None:
    ev = codec.decode(_v1("approval_decided"))
    signed = {
        "decided_at": "2026-12-01T21:00:00.000001+00:00",
        "key_id": "ops",
        "signature": "c2ln",
    }
    v2 = ev.model_copy(update={"payload": ev.payload.model_copy(update=signed)})
    back = codec.decode(codec.encode(v2))
    assert isinstance(back.payload, ApprovalDecided)
    assert (back.payload.decided_at, back.payload.key_id, back.payload.signature) == (
        signed["decided_at"],
        "ops",
        "c2ln",
    )


def test_v1_model_turn_resolves_without_a_recorded_response() -> None:
    ev = codec.decode(_v1("model_turn"))
    assert isinstance(ev.payload, ModelTurn)
    assert ev.schema_version == 2 and ev.payload.response_json is None
    assert ev.payload.text  # the v1 fields are kept as written


def test_v2_model_turn_keeps_the_whole_response() -> None:
    ev = codec.decode(_v1("model_turn"))
    body = '{"parts": [{"part_kind": "text", "content": "hi"}]}'
    v2 = ev.model_copy(update={"payload": ev.payload.model_copy(update={"response_json": body})})
    back = codec.decode(codec.encode(v2))
    assert isinstance(back.payload, ModelTurn) and back.payload.response_json == body
    state_v1, state_v2 = RunState(), RunState()
    apply(state_v1, ev.model_copy(update={"seq": 1}))
    apply(state_v2, back.model_copy(update={"seq": 1}))
    assert state_v1.messages == state_v2.messages  # the fold reads what v1 had, unchanged


def test_v1_compaction_is_upcast_to_its_exact_v1_meaning() -> None:
    ev = codec.decode(_v1("context_compacted"))
    assert ev.schema_version == 2
    assert isinstance(ev.payload, ContextCompacted)
    assert ev.payload.kept_messages == 3 and ev.payload.kept_turns is None


def test_v1_completion_resolves_with_a_null_duration() -> None:
    ev = codec.decode(_v1("tool_call_completed"))
    assert isinstance(ev.payload, ToolCallCompleted)
    assert ev.schema_version == 2 and ev.payload.duration_ms is None


def test_v2_writer_measures_live_tool_calls() -> None:
    fx = load_fixture("v2")
    done = [e.payload for e in fx.events() if isinstance(e.payload, ToolCallCompleted)]
    live = [p for p in done if p.source == "live"]
    assert live and all(p.duration_ms is not None for p in live)


def test_semantic_change_without_upcaster_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(evolution.UPCASTERS, (CC, 1))
    with pytest.raises(MissingUpcaster, match="refusing to guess"):
        codec.decode(_v1("context_compacted"))


def test_compatible_step_must_be_declared(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(codec, "COMPATIBLE_STEPS", frozenset())
    with pytest.raises(MissingUpcaster):
        codec.decode(_v1("tool_call_completed"))


def _encode_with(schema: dict[str, object], record: dict[str, object]) -> bytes:
    parsed = fastavro.parse_schema(schema)
    buf = io.BytesIO()
    buf.write(codec.MAGIC + fingerprint_of(parsed))
    fastavro.schemaless_writer(buf, parsed, record)
    return buf.getvalue()


def test_newer_version_is_rejected_explicitly() -> None:
    raw = json.loads(
        resources.files("runlog.schemas")
        .joinpath("avro", "context_compacted", "v2.avsc")
        .read_text()
    )
    v3 = copy.deepcopy(raw)
    v3["fields"][-1]["type"]["fields"].append({"name": "kept_tokens", "type": "long"})
    ev = codec.decode(load_fixture("v2").records[17].value)
    assert ev.type is CC
    base = codec.avro_record(ev)
    record = {
        **base,
        "schema_version": 3,
        "writer_id": "future",
        "payload": {**base["payload"], "kept_tokens": 1200},
    }
    with pytest.raises(NewerSchemaVersion, match="v3 was written by a newer release"):
        codec.decode(_encode_with(v3, record))
    # Same unknown schema claiming a known version: unknown, not "newer".
    record["schema_version"] = 2
    with pytest.raises(UnknownFingerprint):
        codec.decode(_encode_with(v3, record))


def test_v2_compaction_keeps_turns() -> None:
    events = synthetic_log(["user", "turn", "user", "turn", "call", "complete", "turn"], 0)
    state = RunState()
    for ev in events:
        apply(state, ev)
    before = [m.content for m in state.messages]
    b = codec.make_payload(CC, {"summary": "S", "kept_turns": 2})
    ev = events[-1].model_copy(
        update={"seq": state.seq + 1, "type": CC, "payload": b, "schema_version": 2}
    )
    apply(state, ev)
    # head + summary + from the 2nd-last model turn on (turn, tool result, turn).
    assert [m.content for m in state.messages] == [before[0], "S", *before[-3:]]
    assert state.messages[1].trust == "untrusted"


def test_v1_api_name_kept_still_means_messages() -> None:
    p = codec.make_payload(CC, {"summary": "s", "kept": 4})
    assert isinstance(p, ContextCompacted)
    assert p.kept_messages == 4 and p.kept_turns is None and p.kept == 4
