"""A fork's records in the pure fold: RUN_FORKED begins a run with its parent's state,
FORK_EFFECT_RESOLVED completes an inherited action; no stack needed."""

from __future__ import annotations

from test_run_state import Log, rich_log

from runlog.projections._lineage import fork_key, logical_of, pack_state
from runlog.projections._run_state import RunState, fold, is_valid
from runlog.schemas import _codec as codec
from runlog.schemas._models import Event
from runlog.schemas._vocabulary import EventType


def _parent() -> tuple[list[Event], RunState]:
    """A parent that completed k1 before seq 5 and started k2 at seq 5 (open there)."""
    log = Log("parent-1").start()
    log.user("refund")
    s1 = log.add(
        EventType.TOOL_CALL_STARTED,
        call_id="c1",
        name="charge",
        args_json="{}",
        idempotency_key="k1",
    )
    log.completed(s1, "charged", idempotency_key="k1")
    log.add(
        EventType.TOOL_CALL_STARTED, call_id="c2", name="mail", args_json="{}", idempotency_key="k2"
    )
    at = fold(log.events)
    return log.events, at


def _fork(at: RunState, **extra: object) -> Log:
    fork = Log("fork-1")
    fork.add(
        EventType.RUN_FORKED,
        parent_run_id="parent-1",
        at_seq=at.seq,
        parent_digest=at.digest(),
        forked_by="ops",
        reason="try again",
        key_scope="parent-1",
        state=pack_state(at.to_dict()),
        **extra,
    )
    return fork


def test_a_fork_begins_with_its_parents_state_and_its_own_identity() -> None:
    _, at = _parent()
    fork = _fork(at)
    st = fold(fork.events)
    assert st.run_id == "fork-1" and st.tenant == "acme" and st.seq == 1 and st.epoch == 1
    assert st.status == "running" and st.lineage is not None
    assert st.lineage.parent_run_id == "parent-1" and st.lineage.at_seq == 5
    assert st.completed_calls == {"k1": "charged"}  # the prefix's effects are the fork's own
    assert st.messages == at.messages
    # The open call of the prefix is uncertain to the fork (its writer was the parent's).
    assert st.open_calls["k2"].status == "uncertain"
    # The state survives a snapshot's round trip, lineage included.
    assert RunState.from_dict(st.to_dict()).to_dict() == st.to_dict()
    # And the codec's bytes.
    again = fold([codec.decode(codec.encode(ev)) for ev in fork.events])
    assert again.digest() == st.digest()


def test_a_fork_event_is_only_valid_first() -> None:
    log = rich_log()
    _, at = _parent()
    forked = _fork(at).events[0]
    st = fold(log.events[:3])
    late = forked.model_copy(update={"run_id": st.run_id, "tenant": st.tenant, "seq": st.seq + 1})
    assert not is_valid(st, late)  # a run that began cannot be forked into again
    assert is_valid(RunState(), forked)


def test_a_call_the_parent_completed_after_the_fork_point_settles_in_the_fork() -> None:
    _, at = _parent()
    effect = {
        "logical_key": "k2",
        "key": "k2",
        "run_id": "parent-1",
        "seq": 7,
        "name": "mail",
        "args_json": "{}",
        "risk": "irreversible",
        "status": "completed",
        "content": "sent",
    }
    st = fold(_fork(at, parent_effects=[effect]).events)
    assert "k2" not in st.open_calls and st.completed_calls["k2"] == "sent"
    assert st.lineage is not None and st.lineage.not_inherited() == []


def test_an_inherited_effect_completes_the_logical_key() -> None:
    _, at = _parent()
    effect = {
        "logical_key": "k9",
        "key": "k9",
        "run_id": "parent-1",
        "seq": 9,
        "name": "charge",
        "args_json": '{"n":2}',
        "risk": "irreversible",
        "status": "completed",
        "content": "charged again",
    }
    fork = _fork(at, parent_effects=[effect])
    st = fold(fork.events)
    assert st.lineage is not None and [e.logical_key for e in st.lineage.not_inherited()] == ["k9"]
    fork.add(
        EventType.FORK_EFFECT_RESOLVED,
        logical_key="k9",
        call_id="c9",
        name="charge",
        args_json='{"n":2}',
        resolution="inherited",
        source_run_id="parent-1",
        source_seq=9,
        source_key="k9",
        content="charged again",
        decided_by="effects=inherit",
    )
    st = fold(fork.events)
    assert st.completed_calls["k9"] == "charged again"
    assert st.lineage is not None and st.lineage.not_inherited() == []
    assert st.messages[-1].tool_result is not None
    assert st.messages[-1].tool_result.content == "charged again"


def test_a_forks_own_key_names_its_logical_action() -> None:
    key = fork_key("k2-abc", "r-fork")
    assert key != "k2-abc" and logical_of(key) == "k2-abc" and logical_of("k2-abc") == "k2-abc"


def test_the_audit_names_the_fork_and_what_the_other_timeline_did() -> None:
    from runlog.projections._audit import AuditRun, apply_event

    _, at = _parent()
    effect = {
        "logical_key": "k9",
        "key": "k9",
        "run_id": "parent-1",
        "seq": 9,
        "name": "charge",
        "args_json": '{"n":2}',
        "risk": "irreversible",
        "status": "completed",
        "content": "charged again",
        "compensable": True,
    }
    fork = _fork(at, parent_effects=[effect])
    fork.add(
        EventType.FORK_EFFECT_RESOLVED,
        logical_key="k9",
        call_id="c9",
        name="charge",
        args_json='{"n":2}',
        resolution="repeated",
        source_run_id="parent-1",
        source_seq=9,
        source_key="k9",
        repeat_key=fork_key("k9", "fork-1"),
        decided_by="effects=execute",
    )
    audit = AuditRun()
    got = [e for ev in fork.events for e in apply_event(audit, ev, 0, ev.seq)]
    assert [e["kind"] for e in got] == ["forked", "fork_effect"]
    assert got[0]["parent_run_id"] == "parent-1" and got[0]["forked_by"] == "ops"
    assert got[0]["other_timeline"][0]["compensable"] is True
    assert got[1]["resolution"] == "repeated" and got[1]["repeat_key"] == "k9@fork-1"
    # The projection's own state survives its store's round trip.
    assert AuditRun.from_dict(audit.to_dict()).to_dict() == audit.to_dict()


def test_a_carried_decision_on_an_open_call_is_asked_again_under_trusted_deciders() -> None:
    """The parent decided an escalated call but nobody acted on it before the fork point:
    the decision was signed for the parent's run, and the fork does not carry signatures,
    so under trusted deciders the fork asks a person again (without: it is carried)."""
    from runlog.schemas._signing import generate_key_pair, parse_public_keys

    log = Log("parent-1").start()
    s1 = log.add(
        EventType.TOOL_CALL_STARTED, call_id="c1", name="pay", args_json="{}", idempotency_key="k1"
    )
    log.add(
        EventType.APPROVAL_REQUESTED,
        approval_id="ap1",
        kind="uncertain_call",
        reason="pay may have happened",
        idempotency_key="k1",
        started_seq=s1.seq,
    )
    at = fold(log.events)
    at.approvals["ap1"].approved, at.approvals["ap1"].decided_by = True, "ops"
    call = at.open_calls["k1"]
    call.status, call.decision, call.decided_by = "decided", True, "ops"
    fork = _fork(at)
    assert fold(fork.events).open_calls["k1"].status == "decided"
    _, public = generate_key_pair("ops-key")
    trusted = RunState(authority=parse_public_keys(public))
    st = fold(fork.events, trusted)
    assert st.open_calls["k1"].status == "escalated" and st.open_calls["k1"].decision is None
    assert "ap1" in st.pending_approvals


def test_verify_refuses_a_fork_whose_state_is_not_the_one_its_digest_names() -> None:
    from runlog.consumers._verify import check_lineage, verify_events

    _, at = _parent()
    good = _fork(at).events
    assert check_lineage(good).ok and check_lineage(good).detail.startswith("forked from")
    assert all(c.ok for c in verify_events(good))
    other = RunState.from_dict(at.to_dict())
    other.completed_calls["k-forged"] = "a result nobody produced"
    forged = good[0].model_copy(
        update={
            "payload": good[0].payload.model_copy(update={"state": pack_state(other.to_dict())})
        }
    )
    check = check_lineage([forged])
    assert not check.ok and check.counts == {"digest_mismatch": 1}
    assert check_lineage(rich_log().events).detail == "not a fork"
