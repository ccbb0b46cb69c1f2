"""Decisions signed by deciders: what is signed, who may sign, and the check every reader makes.

Why signatures (Ed25519), not ACLs on who may produce: a decision reaches the log through
whoever holds the run. When the run is free the decider appends it itself, but when a
worker owns it the decision goes through the run's inbox and *the worker* appends it (one
writer per run, the lease's rule), with the worker's Kafka credentials. So the broker's
ACLs cannot tell a decision from a worker's forgery: both are produced by the worker
principal. What can tell them apart is something only a decider can make and every reader
can check in the log itself: a signature by a key workers never hold. Readers verify with
the public keys only (``RUNLOG_DECIDER_PUBLIC_KEYS``); a worker configured with them can
check decisions but not make one. Ed25519: small (64-byte) signatures, fast verification
(~50 us), deterministic, no parameters to get wrong; ``cryptography`` implements it.

What a signature covers (``decision_message``): the run id, tenant, approval id, the
answer, who decided, the note and when, under a domain tag. A valid signature copied onto
another run, tenant or approval, or onto another answer, does not verify.

Policy (``DecisionAuthority``): with no trusted keys (development, deployments from before
signatures) every decision is accepted as before and shown as unsigned; with keys, a
decision that is unsigned, signed by an unknown key or badly signed is a forged decision:
the fold rejects it like a fenced write (kept in the log, excluded from state, named).

This module is pure (no clock, no I/O) except the two loaders at the end, which read key
files for the composition root.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

__all__ = [
    "DOMAIN",
    "DecisionAuthority",
    "DecisionSigner",
    "Signature",
    "Verdict",
    "decision_message",
    "generate_key_pair",
    "load_authority",
    "load_signer",
]

DOMAIN = b"runlog decision v1\n"
"""Prefix of every signed message: a decision's signature is never valid for anything else."""

FORGED = "forged decision: not signed by a decider"


def decision_message(
    *,
    run_id: str,
    tenant: str,
    approval_id: str,
    approved: bool,
    decided_by: str,
    note: str,
    decided_at: str | None,
    answer: str | None = None,
) -> bytes:
    """The exact bytes a decider signs: canonical JSON of the decision's identity and content.

    ``answer`` (APPROVAL_DECIDED v3) is signed when set, so an approval cannot be turned
    into "undo and retry" or back; unset, the bytes are those a v2 decision signed."""
    body: dict[str, object] = {
        "approval_id": approval_id,
        "approved": approved,
        "decided_at": decided_at,
        "decided_by": decided_by,
        "note": note,
        "run_id": run_id,
        "tenant": tenant,
    }
    if answer is not None:
        body["answer"] = answer
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return DOMAIN + text.encode()


@dataclass(frozen=True)
class Verdict:
    """What the authority says of one decision."""

    accepted: bool
    key_id: str | None = None
    """The trusted key that signed it (None: unsigned, accepted only without keys)."""
    why: str = ""
    """For a rejected decision: why (``FORGED`` and the detail)."""
    signed: bool = False
    """The decision carries a signature (checked only when keys are trusted)."""

    @property
    def label(self) -> str:
        if not self.accepted:
            return self.why
        if self.key_id:
            return f"signed by decider key {self.key_id}"
        if self.signed:
            return "signed, not checked (no decider keys trusted)"
        return "unsigned"


@dataclass(frozen=True)
class DecisionAuthority:
    """The trusted deciders' public keys, by name; data for the fold (no I/O).

    Empty: nothing is enforced (every decision accepted, unsigned ones labelled so).
    """

    keys: Mapping[str, bytes] = field(default_factory=dict)
    """key id -> raw 32-byte Ed25519 public key."""

    def __post_init__(self) -> None:
        parsed = {k: Ed25519PublicKey.from_public_bytes(v) for k, v in self.keys.items()}
        object.__setattr__(self, "_parsed", parsed)

    def __deepcopy__(self, memo: dict[int, object]) -> DecisionAuthority:
        return self  # immutable; its parsed keys are not copyable objects

    @property
    def enforcing(self) -> bool:
        return bool(self.keys)

    def fingerprint(self) -> str:
        """Names the key set (snapshots folded under another set are cache misses)."""
        if not self.keys:
            return "none"
        text = ",".join(f"{k}={v.hex()}" for k, v in sorted(self.keys.items()))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def verdict(self, message: bytes, key_id: str | None, signature: str | None) -> Verdict:
        """Whether a decision whose signed bytes are ``message`` counts."""
        if not self.keys:
            return Verdict(True, None, signed=bool(signature))
        if not signature or not key_id:
            return Verdict(False, None, f"{FORGED} (unsigned)")
        public: Ed25519PublicKey | None = getattr(self, "_parsed").get(key_id)  # noqa: B009
        if public is None:
            return Verdict(False, None, f"{FORGED} (key {key_id!r} is not a trusted decider's)")
        try:
            public.verify(base64.b64decode(signature, validate=True), message)
        except (InvalidSignature, ValueError, binascii.Error):
            return Verdict(False, None, f"{FORGED} (bad signature for key {key_id!r})")
        return Verdict(True, key_id, signed=True)


NO_AUTHORITY = DecisionAuthority()


@dataclass(frozen=True)
class Signature:
    """A decider's signature of one decision, as it travels (inbox entry) and is recorded."""

    decided_at: str
    key_id: str
    signature: str

    def fields(self) -> dict[str, str]:
        """The APPROVAL_DECIDED v2 payload fields it fills."""
        return {"decided_at": self.decided_at, "key_id": self.key_id, "signature": self.signature}

    @classmethod
    def from_fields(cls, d: Mapping[str, object]) -> Signature | None:
        """From an inbox entry; None when it carries no signature. Half of one (a field
        missing, null or not text) raises ``ValueError`` naming the field: such an entry is
        malformed, never an unsigned decision."""
        if d.get("signature") is None and d.get("key_id") is None:
            return None
        values = []
        for name in ("decided_at", "key_id", "signature"):
            value = d.get(name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"a signed decision's {name} is {value!r}, not text")
            values.append(value)
        return cls(*values)


@dataclass(frozen=True)
class DecisionSigner:
    """A decider's private key and its name. Held by deciders (operators, the console),
    never by workers."""

    key_id: str
    private: Ed25519PrivateKey = field(repr=False)

    def sign(self, message: bytes) -> str:
        return base64.b64encode(self.private.sign(message)).decode()

    def sign_decision(
        self,
        *,
        run_id: str,
        tenant: str,
        approval_id: str,
        approved: bool,
        decided_by: str,
        note: str,
        decided_at: str,
        answer: str | None = None,
    ) -> Signature:
        message = decision_message(
            run_id=run_id,
            tenant=tenant,
            approval_id=approval_id,
            approved=approved,
            decided_by=decided_by,
            note=note,
            decided_at=decided_at,
            answer=answer,
        )
        return Signature(decided_at, self.key_id, self.sign(message))

    def public_bytes(self) -> bytes:
        return self.private.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )


# ------------------------------------------------------------------------ key files
#
# Private key file: the key's name on a line "# key-id: NAME", then the PKCS#8 PEM
# (``openssl genpkey -algorithm ed25519`` writes the PEM). Mode 0600 or stricter.
# Public keys file: one line per trusted decider, "NAME BASE64-RAW-PUBLIC-KEY"; # comments.


def generate_key_pair(key_id: str) -> tuple[str, str]:
    """``(private key file text, public keys file line)`` of a new decider key."""
    private = Ed25519PrivateKey.generate()
    pem = private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()
    public = DecisionSigner(key_id, private).public_bytes()
    return f"# key-id: {key_id}\n{pem}", f"{key_id} {base64.b64encode(public).decode()}\n"


def load_signer(path: str | os.PathLike[str]) -> DecisionSigner:
    """A decider's key from its file; refuses a file others may read."""
    p = Path(path)
    mode = p.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise PermissionError(
            f"decider key {p} is readable by others (mode {stat.S_IMODE(mode):04o}): chmod 600 {p}"
        )
    text = p.read_text()
    key_id = ""
    for line in text.splitlines():
        if line.startswith("# key-id:"):
            key_id = line.partition(":")[2].strip()
    if not key_id:
        raise ValueError(f"decider key {p} has no '# key-id: NAME' line")
    private = serialization.load_pem_private_key(text.encode(), password=None)
    if not isinstance(private, Ed25519PrivateKey):
        raise ValueError(f"decider key {p} is not an Ed25519 key")
    return DecisionSigner(key_id, private)


def parse_public_keys(text: str, *, where: str = "public keys") -> DecisionAuthority:
    keys: dict[str, bytes] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, _, b64 = line.partition(" ")
        try:
            key = base64.b64decode(b64.strip(), validate=True)
            Ed25519PublicKey.from_public_bytes(key)
        except (ValueError, binascii.Error) as exc:
            raise ValueError(f"{where}:{n}: not 'NAME BASE64-ED25519-KEY': {exc}") from exc
        keys[name] = key
    return DecisionAuthority(keys)


def load_authority(path: str | os.PathLike[str] | None) -> DecisionAuthority:
    """The trusted deciders from a public keys file; none configured: ``NO_AUTHORITY``."""
    if path is None or str(path) == "":
        return NO_AUTHORITY
    p = Path(path)
    authority = parse_public_keys(p.read_text(), where=str(p))
    if not authority.enforcing:
        # A file that names nobody would silently switch the check off: refuse it.
        raise ValueError(f"{p} names no decider key: unset RUNLOG_DECIDER_PUBLIC_KEYS instead")
    return authority
