"""The acceptance rule's integrity inputs, pure (no stack): decider signatures and tenant MACs.

* A decision counts under trusted keys only with a valid signature of *this* decision:
  unsigned, an untrusted key, or a signature moved onto another run, tenant, approval,
  answer, decider or note is a forged decision (rejected, counted, named by verify).
* Without trusted keys every decision counts, labelled unsigned.
* A record of a tenant with a MAC key counts only with that tenant's MAC over its bytes.
* Key files: a decider key readable by others is refused; an empty keys file is refused
  (it would switch the check off silently).
"""

from __future__ import annotations

import base64
import functools
import os
from pathlib import Path
from typing import Any

import pytest
from codec_support import make_event

from runlog._settings import Settings
from runlog.consumers._verify import check_decisions
from runlog.errors import ConfigError
from runlog.log._authority import authority_for, tenant_keys_for
from runlog.projections._run_state import RunState, accept, fold, rejection
from runlog.schemas import _codec as codec
from runlog.schemas._models import Event
from runlog.schemas._signing import (
    DecisionSigner,
    generate_key_pair,
    load_signer,
    parse_public_keys,
)
from runlog.schemas._tenant_mac import parse_tenant_keys
from runlog.schemas._vocabulary import EventType

RID = "r01a2338824a26c63bda29ea43731"


def _signer(tmp: Path, name: str = "ops") -> tuple[DecisionSigner, str]:
    private, public = generate_key_pair(name)
    path = tmp / f"{name}.key"
    path.touch(mode=0o600)
    path.write_text(private)
    return load_signer(path), public


def _log(decision: dict[str, Any], run_id: str = RID, tenant: str = "t") -> list[Event]:
    return [
        make_event(EventType.RUN_STARTED, {}, run_id=run_id, tenant=tenant, seq=1),
        make_event(
            EventType.APPROVAL_REQUESTED,
            {"approval_id": "ap-1", "kind": "action", "reason": "refund"},
            run_id=run_id,
            tenant=tenant,
            seq=2,
        ),
        make_event(EventType.APPROVAL_DECIDED, decision, run_id=run_id, tenant=tenant, seq=3),
    ]


def _signed(signer: DecisionSigner, **over: Any) -> dict[str, Any]:
    what = {
        "run_id": RID,
        "tenant": "t",
        "approval_id": "ap-1",
        "approved": True,
        "decided_by": "alice",
        "note": "ok",
    }
    what.update(over)
    sig = signer.sign_decision(**what, decided_at="2026-12-01T21:00:00.000000+00:00")
    return {
        "approval_id": "ap-1",
        "approved": True,
        "decided_by": "alice",
        "note": "ok",
        **sig.fields(),
    }


def test_a_signed_decision_counts_and_names_its_key(tmp_path: Path) -> None:
    signer, public = _signer(tmp_path)
    keys = parse_public_keys(public)
    st = fold(_log(_signed(signer)), RunState(authority=keys))
    assert st.approvals["ap-1"].approved is True and st.approvals["ap-1"].key_id == "ops"
    assert st.fenced_writes == 0
    # The key is in the state (to_dict) only when it signed: unsigned states compare as before.
    assert st.to_dict()["approvals"]["ap-1"]["key_id"] == "ops"
    assert "authority" not in st.to_dict()


@pytest.mark.parametrize(
    "moved",
    [
        {"run_id": "r01a2338824a26c63bda29ea43799"},  # another run
        {"tenant": "other"},  # another tenant
        {"approval_id": "ap-2"},  # another approval
        {"approved": False},  # the other answer
        {"decided_by": "mallory"},  # another decider
        {"note": "no"},  # another note
    ],
)
def test_a_signature_of_another_decision_is_a_forgery(
    tmp_path: Path, moved: dict[str, Any]
) -> None:
    signer, public = _signer(tmp_path)
    keys = parse_public_keys(public)
    events = _log(_signed(signer, **moved))
    st = RunState(authority=keys)
    for ev in events[:2]:
        assert accept(st, ev)
    assert rejection(st, events[2]) == "forged_decision"
    assert not accept(st, events[2])
    assert st.approvals["ap-1"].approved is None and st.fenced_writes == 1 and st.seq == 2
    check = check_decisions(events, keys)
    assert not check.ok and "bad signature" in check.detail and check.counts == {"forged": 1}


def test_unsigned_and_untrusted_decisions_are_forgeries_only_under_keys(tmp_path: Path) -> None:
    _, public = _signer(tmp_path)
    stranger, _ = _signer(tmp_path, "ops")  # same name, another key
    keys = parse_public_keys(public)
    unsigned = {"approval_id": "ap-1", "approved": True, "decided_by": "alice", "note": "ok"}
    for decision in (unsigned, _signed(stranger)):
        assert fold(_log(decision), RunState(authority=keys)).approvals["ap-1"].approved is None
        st = fold(_log(decision))  # no keys trusted: accepted as before
        assert st.approvals["ap-1"].approved is True and st.approvals["ap-1"].key_id is None
    ok = check_decisions(_log(unsigned))
    assert ok.ok and ok.counts == {"unsigned": 1} and "no decider keys" in ok.detail


def test_key_files_are_checked(tmp_path: Path) -> None:
    private, public = generate_key_pair("ops")
    loose = tmp_path / "loose.key"
    loose.write_text(private)
    loose.chmod(0o644)
    with pytest.raises(PermissionError):
        load_signer(loose)
    empty = tmp_path / "none.pub"
    empty.write_text("# nobody\n")
    with pytest.raises(ConfigError):
        authority_for(Settings(decider_public_keys=str(empty)))
    missing = Settings(decider_public_keys=str(tmp_path / "absent.pub"))
    with pytest.raises(ConfigError):  # never "no keys, accept everything"
        authority_for(missing)
    good = tmp_path / "ok.pub"
    good.write_text(public)
    assert authority_for(Settings(decider_public_keys=str(good))).enforcing


def _keys(*tenants: str) -> str:
    return "".join(f"{t} {t}-1 {base64.b64encode(os.urandom(32)).decode()}\n" for t in tenants)


def test_a_record_counts_only_with_its_tenants_mac() -> None:
    readers = parse_tenant_keys(_keys("a", "b"))
    a_only = parse_tenant_keys(_keys("a"))  # tenant a's workers' key
    ev = make_event(EventType.USER_MESSAGE, {"content": "hi"}, run_id=RID, tenant="b", seq=2)
    value, key = codec.encode(ev), RID.encode()
    b_header = readers.header("b", key, value)
    assert b_header is not None
    assert readers.check("b", key, value, [b_header]) is None
    assert "no MAC" in str(readers.check("b", key, value, []))
    assert "bad MAC" in str(readers.check("b", key, value + b"x", [b_header]))
    a_header = a_only.header("a", key, value)
    assert a_header is not None
    assert "not one of tenant 'b'" in str(readers.check("b", key, value, [a_header]))
    # An unlisted tenant is not checked (deployments where tenants share workers).
    assert readers.check("c", key, value, []) is None
    st = RunState()
    accept(st, make_event(EventType.RUN_STARTED, {}, run_id=RID, tenant="b", seq=1))
    assert rejection(st, ev, "forged") == "forged_tenant"
    assert not accept(st, ev, "forged") and st.seq == 1 and st.fenced_writes == 1


def test_tenant_key_files_are_checked(tmp_path: Path) -> None:
    short = tmp_path / "short"
    short.write_text(f"a a-1 {base64.b64encode(b'x' * 8).decode()}\n")
    with pytest.raises(ConfigError):
        tenant_keys_for(Settings(tenant_keys=str(short)))
    with pytest.raises(ConfigError):
        tenant_keys_for(Settings(tenant_keys=str(tmp_path / "absent")))


def test_a_snapshot_folded_under_other_keys_is_a_cache_miss(tmp_path: Path) -> None:
    """Which decisions and records a state counts depends on the keys it was folded under:
    a snapshot is continued only by a reader that trusts the same ones."""
    from runlog.log._snapshots import SnapshotInvalid, decode_body, encode_body

    signer, public = _signer(tmp_path)
    keys = parse_public_keys(public)
    st = fold(_log(_signed(signer)), RunState(authority=keys))
    macs = parse_tenant_keys(_keys("t")).fingerprint("t")
    body = encode_body(st, tenant="t", run_id=RID, partition=0, offset=3, tenant_macs=macs)
    load = functools.partial(decode_body, body, key="k", tenant="t", run_id=RID, partition=0)
    back = load(authority=keys, tenant_macs=macs)
    assert back.state == st and back.state.authority is keys
    with pytest.raises(SnapshotInvalid) as miss:
        load(tenant_macs=macs)
    assert miss.value.reason == "deciders"
    with pytest.raises(SnapshotInvalid) as miss:
        load(authority=keys)
    assert miss.value.reason == "tenant_macs"


def test_show_says_who_signed_a_decision_and_names_a_forgery(tmp_path: Path) -> None:
    """``runlog show``'s story (``timeline.build``) and the audit entries, from the log."""
    from runlog.consumers._timeline import build
    from runlog.log._reader import LogRecord
    from runlog.projections import _audit as audit

    signer, public = _signer(tmp_path)
    keys = parse_public_keys(public)
    unsigned = {"approval_id": "ap-1", "approved": True, "decided_by": "alice", "note": "ok"}

    def told(decision: dict[str, Any], authority: Any) -> str:
        records = [LogRecord(ev, 0, i) for i, ev in enumerate(_log(decision))]
        _, entries, _, _ = build(records, frozenset(), authority)
        return str(entries[-1]["text"])

    assert told(unsigned, parse_public_keys("")).endswith("(unsigned)")
    assert told(_signed(signer), keys).endswith("(signed by decider key ops)")
    forged = told(unsigned, keys)
    assert forged.startswith("FORGED DECISION") and "not signed by a decider" in forged
    run = audit.AuditRun(validator=RunState(authority=keys))
    got = [e for ev in _log(_signed(signer)) for e in audit.apply_event(run, ev, 0, ev.seq)]
    assert got[-1]["kind"] == "approval_decided" and got[-1]["key_id"] == "ops"
    run = audit.AuditRun(validator=RunState(authority=keys))
    got = [e for ev in _log(unsigned) for e in audit.apply_event(run, ev, 0, ev.seq)]
    assert got[-1]["kind"] == "forged_decision" and got[-1]["decided_by"] == "alice"
