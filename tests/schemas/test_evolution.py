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
from runlog.projections._run_state import FOLD_VERSION, RunState, apply
from runlog.schemas import _codec as codec
from runlog.schemas import _evolution as evolution
from runlog.schemas._models import (
    ApprovalDecided,
    ApprovalRequested,
    ContextCompacted,
    Event,
    ModelTurn,
    RunResumed,
    ToolCallCompleted,
    ToolCallStarted,
)
from runlog.schemas._registry import fingerprint_of, registry
from runlog.schemas._sealing import SEALED_SINCE
from runlog.schemas._vocabulary import EventType

CC = EventType.CONTEXT_COMPACTED
TCC = EventType.TOOL_CALL_COMPLETED
MT = EventType.MODEL_TURN
TCS = EventType.TOOL_CALL_STARTED
AR = EventType.APPROVAL_REQUESTED
AD = EventType.APPROVAL_DECIDED
RR = EventType.RUN_RESUMED


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
    # The sealed versions (schemas._sealing): every type with content fields moved one up.
    assert registry().current[CC] == 3
    assert registry().current[TCC] == 3
    assert registry().current[MT] == 3
    assert registry().current[TCS] == 3
    assert registry().current[AR] == 3
    assert registry().current[AD] == 3
    assert registry().current[RR] == 2
    assert registry().current[EventType.RUN_CANCEL_REQUESTED] == 2
    assert registry().current[EventType.RUN_STARTED] == 3
    assert registry().current[EventType.TIMER_STARTED] == 1
    for et, since in SEALED_SINCE.items():
        # RUN_FORKED v3 also seals ``state`` and names the fork's ``subject``.
        assert registry().current[et] == (3 if et is EventType.RUN_FORKED else since)
    assert registry().current[EventType.CONTENT_ERASED] == 1
    assert FOLD_VERSION == 8


def test_v1_resumption_resolves_as_a_workers_and_counts() -> None:
    """RUN_RESUMED v2 adds ``operator`` (default null): a v1 record resolves as a worker's
    resumption, counted as every v1 reader counted it."""
    ev = codec.decode(_v1("run_resumed"))
    assert isinstance(ev.payload, RunResumed) and ev.schema_version == 2
    assert ev.payload.operator is None
    state = RunState()
    for e in load_fixture("v1").events():
        apply(state, e)
    fx = load_fixture("v1")
    assert state.resumptions == fx.states[max(fx.states)]["resumptions"] > 0


def test_an_operators_takeover_is_not_a_resumption_and_a_cancel_is_kept() -> None:
    """v2 names the person whose act took the run: the fold does not count it; a
    RUN_CANCEL_REQUESTED is kept (the first stands) and survives a snapshot's round trip."""
    events = [e for e in load_fixture("v1").events()]
    state = RunState()
    for e in events:
        if e.type is EventType.RUN_FINISHED:
            break
        apply(state, e)
    before = state.resumptions
    seq, epoch = state.seq, state.epoch
    resumed = codec.build_event(
        RR,
        {"previous_epoch": epoch, "expected_prev_seq": seq, "operator": "ann", "reason": "x"},
        run_id=state.run_id,
        tenant=state.tenant,
        seq=seq + 1,
        epoch=epoch + 1,
        writer_id="op",
    )
    back = codec.decode(codec.encode(resumed))
    assert isinstance(back.payload, RunResumed) and back.payload.operator == "ann"
    assert apply(state, back).resumptions == before
    for n, who in ((2, "ann"), (3, "bob")):
        asked = codec.build_event(
            EventType.RUN_CANCEL_REQUESTED,
            {"requested_by": who, "reason": f"stop {who}"},
            run_id=state.run_id,
            tenant=state.tenant,
            seq=seq + n,
            epoch=epoch + 1,
            writer_id="op",
        )
        apply(state, codec.decode(codec.encode(asked)))
    assert state.seq == seq + 3 and state.cancel is not None
    assert (state.cancel.requested_by, state.cancel.requested_seq) == ("ann", seq + 2)
    assert RunState.from_dict(state.to_dict()).to_dict() == state.to_dict()


def test_v1_start_resolves_as_not_started_by_an_agent() -> None:
    """A v1 RUN_STARTED (before the agent registry) reads as v2 with no code version or
    input, and folds to a state without a registered agent, as the v1 fold did."""
    from runlog.schemas._models import RunStarted

    ev = codec.decode(_v1("run_started"))
    assert (
        isinstance(ev.payload, RunStarted)
        and ev.schema_version == registry().current[EventType.RUN_STARTED]
    )
    assert (ev.payload.code_version, ev.payload.input_json) == (None, None)
    st = RunState()
    apply(st, ev)
    assert st.agent_name is None and st.agent_version is None and st.timers == ()
    assert "agent_name" not in st.to_dict()


def test_v1_decision_resolves_as_unsigned() -> None:
    ev = codec.decode(_v1("approval_decided"))
    assert isinstance(ev.payload, ApprovalDecided) and ev.schema_version == 3
    assert ev.payload.answer is None  # approve or reject, exactly as it said
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


def test_v2_decision_resolves_without_an_answer_and_its_signature_still_holds() -> None:
    """approval_decided v3 adds ``answer`` ("undo and retry"). A v2 record resolves with
    none, and the bytes its decider signed are unchanged: the v4 fixture's signed decision
    is still accepted under the fixture's decider key, and states fold as recorded."""
    fx = load_fixture("v4")
    raw = next(r for r in fx.records if r.type == "approval_decided")
    assert codec.writer_schema_of(raw.value).version == 2
    ev = codec.decode(raw.value)
    assert isinstance(ev.payload, ApprovalDecided) and ev.schema_version == 3
    assert ev.payload.answer is None and ev.payload.signature is not None


def test_the_answer_is_signed_with_the_decision() -> None:
    """A signature of an approval does not cover "undo and retry" of it, nor back."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from runlog.schemas._signing import DecisionAuthority, DecisionSigner, decision_message

    signer = DecisionSigner("ops", Ed25519PrivateKey.generate())
    authority = DecisionAuthority({"ops": signer.public_bytes()})
    ident = {"run_id": "r1", "tenant": "t", "approval_id": "ap-1", "approved": True}
    ident |= {"decided_by": "ops", "note": ""}
    sig = signer.sign_decision(**ident, decided_at="2026-12-02T00:00:00+00:00")
    plain = decision_message(**ident, decided_at=sig.decided_at)
    undo = decision_message(**ident, decided_at=sig.decided_at, answer="undo_and_retry")
    assert authority.verdict(plain, sig.key_id, sig.signature).accepted
    assert not authority.verdict(undo, sig.key_id, sig.signature).accepted
    both = signer.sign_decision(**ident, decided_at=sig.decided_at, answer="undo_and_retry")
    assert authority.verdict(undo, both.key_id, both.signature).accepted
    assert not authority.verdict(plain, both.key_id, both.signature).accepted


def test_v1_tool_call_started_resolves_with_its_declarations_not_recorded() -> None:
    ev = codec.decode(_v1("tool_call_started"))
    assert isinstance(ev.payload, ToolCallStarted)
    assert ev.schema_version == registry().current[TCS]
    # Null is "not recorded", never "declared false": a reader must not guess either way.
    assert ev.payload.dedupes_by_key is None and ev.payload.compensable is None
    assert ev.payload.idempotency_key and ev.payload.args_json  # the v1 fields as written


def test_v2_tool_call_started_keeps_its_declarations() -> None:
    ev = codec.decode(_v1("tool_call_started"))
    update = {"dedupes_by_key": True, "compensable": False}
    v2 = ev.model_copy(update={"payload": ev.payload.model_copy(update=update)})
    back = codec.decode(codec.encode(v2))
    assert isinstance(back.payload, ToolCallStarted)
    assert (back.payload.dedupes_by_key, back.payload.compensable) == (True, False)
    state_v1, state_v2 = RunState(), RunState()
    apply(state_v1, ev.model_copy(update={"seq": 1}))
    apply(state_v2, back.model_copy(update={"seq": 1}))
    assert state_v1.to_dict() == state_v2.to_dict()  # the fold reads what v1 had, unchanged


def test_the_fixture_of_each_release_holds_its_versions() -> None:
    """v3: the release of model_turn v2 (tool_call_started, approval_requested and
    approval_decided v1); v4: tool_call_started v2 (a tool's retry declarations),
    approval_requested v2 (a deadline) and approval_decided v2 (a decider's signature)."""
    written = {v: set(load_fixture(v).meta["written_versions"]) for v in ("v3", "v4")}
    old = {"tool_call_started v1", "approval_requested v1", "approval_decided v1"}
    new = {"tool_call_started v2", "approval_requested v2", "approval_decided v2"}
    assert {"model_turn v2"} | old <= written["v3"]
    assert {"model_turn v2"} | new <= written["v4"]
    ev = codec.decode(next(r.value for r in load_fixture("v3").records if r.type == "model_turn"))
    assert isinstance(ev.payload, ModelTurn) and ev.payload.text


def test_v1_approval_request_resolves_without_a_deadline() -> None:
    ev = codec.decode(_v1("approval_requested"))
    assert isinstance(ev.payload, ApprovalRequested)
    assert ev.schema_version == registry().current[AR] and ev.payload.due_at is None
    state = RunState()
    for e in load_fixture("v1").events():
        apply(state, e)
    approval = state.approvals[ev.payload.approval_id]
    assert approval.due_at is None
    # A state without deadlines serialises exactly as before the field existed.
    assert "due_at" not in state.to_dict()["approvals"][approval.approval_id]


def test_v2_approval_request_keeps_its_deadline_through_fold_and_snapshot() -> None:
    fx = load_fixture("v4")
    raw = next(r for r in fx.records if r.type == "approval_requested")
    assert raw.schema_version == 2 and codec.writer_schema_of(raw.value).version == 2
    ev = codec.decode(raw.value)
    assert isinstance(ev.payload, ApprovalRequested) and ev.payload.due_at is not None
    assert ev.payload.due_at > ev.occurred_at  # written as an absolute time after the request
    state = RunState()
    for e in fx.events():
        apply(state, e)
    approval = state.approvals[ev.payload.approval_id]
    assert approval.due_at == ev.payload.due_at
    assert RunState.from_dict(state.to_dict()) == state


def test_v1_model_turn_resolves_without_a_recorded_response() -> None:
    ev = codec.decode(_v1("model_turn"))
    assert isinstance(ev.payload, ModelTurn)
    assert ev.schema_version == registry().current[MT] and ev.payload.response_json is None
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


def test_v4_writer_records_each_tools_retry_declarations() -> None:
    """The v4 fixture's writer stamped every STARTED with what its tool declared."""
    fx = load_fixture("v4")
    started = [e.payload for e in fx.events() if isinstance(e.payload, ToolCallStarted)]
    assert {
        codec.writer_schema_of(r.value).version for r in fx.records if r.type == "tool_call_started"
    } == {2}
    declared = {(p.name, p.dedupes_by_key, p.compensable) for p in started}
    assert ("charge", True, False) in declared  # declared dedupes_by_key=True
    assert ("lookup", False, False) in declared  # declared nothing


def test_v1_compaction_is_upcast_to_its_exact_v1_meaning() -> None:
    ev = codec.decode(_v1("context_compacted"))
    assert ev.schema_version == registry().current[CC]
    assert isinstance(ev.payload, ContextCompacted)
    assert ev.payload.kept_messages == 3 and ev.payload.kept_turns is None


def test_v1_completion_resolves_with_a_null_duration() -> None:
    ev = codec.decode(_v1("tool_call_completed"))
    assert isinstance(ev.payload, ToolCallCompleted)
    assert ev.schema_version == registry().current[TCC] and ev.payload.duration_ms is None


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
        .joinpath("avro", "context_compacted", f"v{registry().current[CC]}.avsc")
        .read_text()
    )
    top = registry().current[CC]
    v3 = copy.deepcopy(raw)
    v3["fields"][-1]["type"]["fields"].append({"name": "kept_tokens", "type": "long"})
    ev = codec.decode(load_fixture("v2").records[17].value)
    assert ev.type is CC
    base = codec.avro_record(ev)
    record = {
        **base,
        "schema_version": top + 1,
        "writer_id": "future",
        "payload": {**base["payload"], "kept_tokens": 1200},
    }
    with pytest.raises(NewerSchemaVersion, match=f"v{top + 1} was written by a newer release"):
        codec.decode(_encode_with(v3, record))
    # Same unknown schema claiming a known version: unknown, not "newer".
    record["schema_version"] = top
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


def test_content_erased_is_valid_only_after_the_finish_and_erases_the_content() -> None:
    """CONTENT_ERASED (v1) counts only on a finished run, at the next seq, above the
    current epoch; the state then reads ``ERASED`` in every content field, keeps its
    structure and the erasure record, and survives a snapshot's round trip."""
    from runlog.schemas._models import ERASED

    events = list(load_fixture("v1").events())
    state = RunState()
    for e in events:
        apply(state, e)
    assert state.status == "finished"
    texts = [msg.content for msg in state.messages if msg.content]
    assert texts and state.completed_calls
    seq, epoch = state.seq, state.epoch

    def erased(n: int, ep: int, who: str) -> Event:
        ev = codec.build_event(
            EventType.CONTENT_ERASED,
            {"subject": "user-42", "key_ids": ["k1"], "erased_by": who, "reason": "art. 17"},
            run_id=state.run_id,
            tenant=state.tenant,
            seq=n,
            epoch=ep,
            writer_id="op",
        )
        return codec.decode(codec.encode(ev))

    structure = (state.turns, state.outcome, sorted(state.completed_calls), state.input_tokens)
    fenced = state.fenced_writes
    apply(state, erased(seq + 1, epoch, "eve"))  # not above the epoch: fenced
    assert state.erased is None and state.fenced_writes == fenced + 1
    apply(state, erased(seq + 1, epoch + 1, "ann"))
    assert state.erased is not None and state.erased.erased_by == "ann"
    assert state.erased.key_ids == ["k1"] and state.erased.erased_seq == seq + 1
    assert all(msg.content in ("", ERASED) for msg in state.messages)
    assert set(state.completed_calls.values()) == {ERASED}
    assert state.summary in ("", ERASED)
    after = (state.turns, state.outcome, sorted(state.completed_calls), state.input_tokens)
    assert after == structure
    assert RunState.from_dict(state.to_dict()).to_dict() == state.to_dict()
    # Still finished: nothing else is valid after it.
    assert state.status == "finished"
