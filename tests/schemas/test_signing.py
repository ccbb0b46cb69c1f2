"""Decisions signed by deciders (``runlog.schemas._signing``), the module on its own.

* What is signed: the decision's identity and content under a domain tag; two different
  decisions never have the same signed bytes, so a signature holds for its decision only,
  and a signature of the same content without the tag (anything else a key may sign) does
  not count.
* The authority's verdicts: with trusted keys, a valid signature is accepted and names its
  key; a signature that is not even well-formed is a forgery naming the key, never a
  crash. Without keys every decision is accepted and labelled for what it carries.
* The key set's fingerprint names the set (not the order it was given in).
* ``Signature.from_fields``: none without a signature, refused if half of one.
* Key files: a generated pair loads back; a private key without its name, a public keys
  file that names nobody, and a bad public key line are refused naming the file (and line).

Moved signatures and forged decisions in the fold: tests/security/test_integrity.py.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runlog.schemas._signing import (
    DOMAIN,
    DecisionAuthority,
    DecisionSigner,
    Signature,
    decision_message,
    generate_key_pair,
    load_authority,
    load_signer,
    parse_public_keys,
)

FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

WHEN = "2026-12-01T21:00:00.000000+00:00"
DECISION: dict[str, Any] = {
    "run_id": "r-1",
    "tenant": "t",
    "approval_id": "ap-1",
    "approved": True,
    "decided_by": "alice",
    "note": "ok",
    "decided_at": WHEN,
}


def _signer(name: str = "ops") -> DecisionSigner:
    return DecisionSigner(name, Ed25519PrivateKey.generate())


def _authority(*signers: DecisionSigner) -> DecisionAuthority:
    return DecisionAuthority({s.key_id: s.public_bytes() for s in signers})


# Small alphabets, so two drawn decisions often differ in one field only, or share text
# that a careless encoding would let slide from one field into the next.
_part = st.text(alphabet='ab",:\\{}', max_size=4)
decisions = st.fixed_dictionaries(
    {
        "run_id": _part,
        "tenant": _part,
        "approval_id": _part,
        "approved": st.booleans(),
        "decided_by": _part,
        "note": _part,
        "decided_at": st.none() | _part,
        "answer": st.none() | _part,
    }
)


@FAST
@given(decisions, decisions)
def test_two_decisions_have_the_same_signed_bytes_only_if_they_are_the_same(
    a: dict[str, Any], b: dict[str, Any]
) -> None:
    assert (decision_message(**a) == decision_message(**b)) == (a == b)


def test_a_signature_counts_for_its_decision_only_and_only_under_the_domain_tag() -> None:
    signer = _signer()
    authority = _authority(signer)
    sig = signer.sign_decision(**DECISION)
    assert sig.key_id == "ops" and sig.decided_at == WHEN
    message = decision_message(**DECISION)
    assert message.startswith(DOMAIN)
    assert authority.verdict(message, sig.key_id, sig.signature).accepted
    # Signed a moment later: another decision.
    later = decision_message(**{**DECISION, "decided_at": "2026-12-01T21:00:01.000000+00:00"})
    assert not authority.verdict(later, sig.key_id, sig.signature).accepted
    # The same content signed without the tag (as some other protocol might) is no decision.
    untagged = signer.sign(message[len(DOMAIN) :])
    assert not authority.verdict(message, "ops", untagged).accepted


@pytest.mark.parametrize(
    "signature",
    [
        pytest.param("not base64!", id="not-base64"),
        pytest.param(base64.b64encode(b"\x00" * 10).decode(), id="too-short"),
        pytest.param(base64.b64encode(b"\x00" * 64).decode(), id="zeros"),
        pytest.param("QUJD=" + "A" * 80, id="padding-inside"),
    ],
)
def test_a_malformed_signature_is_a_forgery_naming_the_key_not_a_crash(signature: str) -> None:
    authority = _authority(_signer())
    verdict = authority.verdict(decision_message(**DECISION), "ops", signature)
    assert not verdict.accepted and verdict.key_id is None
    assert "forged decision" in verdict.label and "'ops'" in verdict.label


def test_verdicts_and_their_labels_with_and_without_trusted_keys() -> None:
    signer = _signer()
    sig = signer.sign_decision(**DECISION)
    message = decision_message(**DECISION)

    enforcing = _authority(signer)
    assert enforcing.enforcing
    good = enforcing.verdict(message, sig.key_id, sig.signature)
    assert good.accepted and good.key_id == "ops" and good.label == "signed by decider key ops"
    unsigned = enforcing.verdict(message, None, None)
    assert not unsigned.accepted and "unsigned" in unsigned.label
    stranger = enforcing.verdict(message, "eve", sig.signature)
    assert not stranger.accepted and "'eve'" in stranger.label

    # No keys: nothing is enforced, whatever the decision carries.
    open_ = DecisionAuthority()
    assert not open_.enforcing
    assert open_.verdict(message, None, None).accepted
    assert open_.verdict(message, None, None).label == "unsigned"
    carried = open_.verdict(message, "eve", "garbage")
    assert carried.accepted and carried.key_id is None
    assert carried.label == "signed, not checked (no decider keys trusted)"


def test_the_fingerprint_names_the_key_set() -> None:
    a, b = _signer("a"), _signer("b")
    assert DecisionAuthority().fingerprint() == "none"
    ab = DecisionAuthority({"a": a.public_bytes(), "b": b.public_bytes()})
    ba = DecisionAuthority({"b": b.public_bytes(), "a": a.public_bytes()})
    assert ab.fingerprint() == ba.fingerprint() != "none"
    others = {
        DecisionAuthority({"a": a.public_bytes()}).fingerprint(),  # one key fewer
        DecisionAuthority({"a": a.public_bytes(), "c": b.public_bytes()}).fingerprint(),  # renamed
        DecisionAuthority({"a": a.public_bytes(), "b": _signer().public_bytes()}).fingerprint(),
    }
    assert ab.fingerprint() not in others and len(others) == 3


def test_a_signature_travels_as_fields_and_half_of_one_is_refused() -> None:
    sig = _signer().sign_decision(**DECISION)
    assert Signature.from_fields({"approval_id": "ap-1", **sig.fields()}) == sig
    assert Signature.from_fields({"approval_id": "ap-1"}) is None
    assert Signature.from_fields({"signature": None, "key_id": None}) is None
    with pytest.raises(ValueError, match="key_id"):
        Signature.from_fields({"signature": sig.signature, "decided_at": WHEN})


@pytest.mark.parametrize("field", ["key_id", "decided_at", "signature"])
def test_a_signature_with_a_null_field_is_half_of_one(field: str) -> None:
    """Half a signature is a malformed decision (set aside for a person), never an unsigned
    one: a null field is not read as the text 'None'."""
    sig = _signer().sign_decision(**DECISION)
    fields = {**sig.fields(), field: None}
    if fields["signature"] is None and fields["key_id"] is None:
        return
    with pytest.raises(ValueError, match=field):
        Signature.from_fields(fields)


def test_key_files_load_back_and_bad_ones_are_refused_naming_them(tmp_path: Path) -> None:
    private, public = generate_key_pair("ops")
    key = tmp_path / "ops.key"
    key.touch(mode=0o600)
    key.write_text(private)
    signer = load_signer(key)
    assert signer.key_id == "ops"
    authority = parse_public_keys(public)
    assert authority.keys == {"ops": signer.public_bytes()}
    sig = signer.sign_decision(**DECISION)
    assert authority.verdict(decision_message(**DECISION), "ops", sig.signature).accepted

    nameless = tmp_path / "nameless.key"
    nameless.touch(mode=0o600)
    nameless.write_text(private.split("\n", 1)[1])  # the PEM without its "# key-id:" line
    with pytest.raises(ValueError, match="key-id") as err:
        load_signer(nameless)
    assert str(nameless) in str(err.value)

    assert not load_authority(None).enforcing and not load_authority("").enforcing
    nobody = tmp_path / "nobody.pub"
    nobody.write_text("# every decider left\n\n")
    with pytest.raises(ValueError) as err:
        load_authority(nobody)
    assert str(nobody) in str(err.value) and "RUNLOG_DECIDER_PUBLIC_KEYS" in str(err.value)

    bad = f"# deciders\n{public}carol not-a-key\n"
    with pytest.raises(ValueError) as err:
        parse_public_keys(bad, where="deciders.pub")
    assert "deciders.pub:3" in str(err.value)
