"""Tenants' writers apart: a per-tenant HMAC-SHA256 over each record, checked by readers.

Why a MAC and not per-tenant principals and topics: all tenants share one events topic (a
run's partition is fixed by its id, the fleet's dispatch rides the topic's partitions), so
Kafka's ACLs, which grant per topic, cannot say "this principal writes tenant A's runs
only". A MAC can, without changing the topic layout or the schemas: a tenant's workers
hold that tenant's secret and nobody else's; readers (projection services, operators,
verify) hold every tenant's. A worker of tenant A can still *produce* a record that claims
tenant B (its principal may write the topic), but it cannot make B's MAC, so every reader
rejects the record like a fenced write ("forged_tenant"): kept in the log, excluded from
state, named by verify.

Optional, per tenant: a tenant absent from a reader's key file is not checked (deployments
whose tenants share workers, e.g. one worker pool serving every tenant of one customer,
gain nothing from it: their workers would hold every key). Once a tenant has a key in the
readers' file, each of its records must carry a valid MAC, older records included: turn it
on for a tenant before its first run, or accept that its earlier records become forgeries.

What the MAC covers: the record's key (the run id) and value (the encoded event: envelope
with run id, tenant, seq, epoch, type, and the payload), under a domain tag. It travels in
the ``runlog.mac`` header as ``KEY_ID:HEX``; the key id allows rotation (a reader may hold
several keys of a tenant; a writer signs with the first).

Pure: no I/O but ``parse``'s caller reading the file (``runlog.log._authority``).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

__all__ = ["HEADER", "NO_TENANT_KEYS", "TenantKeys", "parse_tenant_keys"]

HEADER = "runlog.mac"
DOMAIN = b"runlog record v1\n"
FORGED = "forged tenant record"


def _mac(secret: bytes, key: bytes, value: bytes) -> str:
    msg = DOMAIN + len(key).to_bytes(4, "big") + key + value
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class TenantKeys:
    """Tenant -> [(key id, secret)], the first one current. Empty: nothing is checked."""

    keys: Mapping[str, tuple[tuple[str, bytes], ...]] = field(default_factory=dict)

    def __deepcopy__(self, memo: dict[int, object]) -> TenantKeys:
        return self

    @property
    def enforcing(self) -> bool:
        return bool(self.keys)

    def fingerprint(self, tenant: str) -> str:
        """Names the keys ``tenant``'s records are checked with ("none": unchecked), so a
        snapshot folded under other keys is a cache miss; secrets never leave as such."""
        held = self.keys.get(tenant)
        if not held:
            return "none"
        text = "|".join(f"{kid}:{secret.hex()}" for kid, secret in held)
        return hashlib.sha256(b"runlog tenant keys\n" + text.encode()).hexdigest()[:16]

    def header(self, tenant: str, key: bytes, value: bytes) -> tuple[str, bytes] | None:
        """The ``runlog.mac`` header a writer of ``tenant`` adds (None: it holds no key)."""
        held = self.keys.get(tenant)
        if not held:
            return None
        key_id, secret = held[0]
        return HEADER, f"{key_id}:{_mac(secret, key, value)}".encode()

    def check(
        self,
        tenant: str,
        key: bytes,
        value: bytes,
        headers: Iterable[tuple[str, str | bytes | None]] | None,
    ) -> str | None:
        """None if the record counts for ``tenant`` (authenticated, or tenant unchecked);
        otherwise why it is a forgery."""
        held = self.keys.get(tenant)
        if not held:
            return None
        found = [v for k, v in headers or () if k == HEADER]
        if not found or found[-1] is None:
            return f"{FORGED}: no MAC of tenant {tenant!r}"
        raw = found[-1]
        text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
        key_id, _, digest = text.partition(":")
        for kid, secret in held:
            if kid == key_id:
                if hmac.compare_digest(digest, _mac(secret, key, value)):
                    return None
                return f"{FORGED}: bad MAC for tenant {tenant!r} key {key_id!r}"
        return f"{FORGED}: key {key_id!r} is not one of tenant {tenant!r}'s"


NO_TENANT_KEYS = TenantKeys()


def parse_tenant_keys(text: str, *, where: str = "tenant keys") -> TenantKeys:
    """``TENANT KEY_ID BASE64-SECRET`` per line (# comments); at least 16 bytes a secret."""
    keys: dict[str, list[tuple[str, bytes]]] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 3:
            raise ValueError(f"{where}:{n}: not 'TENANT KEY_ID BASE64-SECRET'")
        tenant, key_id, b64 = parts
        try:
            secret = base64.b64decode(b64, validate=True)
        except (ValueError, binascii.Error) as exc:
            raise ValueError(f"{where}:{n}: secret is not base64: {exc}") from exc
        if len(secret) < 16:
            raise ValueError(f"{where}:{n}: secret of {tenant} has {len(secret)} bytes (< 16)")
        keys.setdefault(tenant, []).append((key_id, secret))
    return TenantKeys({t: tuple(v) for t, v in keys.items()})
