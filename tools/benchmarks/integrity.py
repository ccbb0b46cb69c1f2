"""What the integrity checks cost per record (``runlog bench integrity``): CPU only, no stack.

* per-tenant record MAC (``schemas._tenant_mac``): the writer's HMAC-SHA256 per append and
  each reader's check per record, beside what encoding (writer) and decoding (reader) the
  same record costs anyway;
* decider signatures (``schemas._signing``): one Ed25519 signature per decision (decider)
  and one verification per decision per reader (only APPROVAL_DECIDED records pay it).

Prints microseconds per operation (median of repeats) for small and large records.
"""

from __future__ import annotations

import base64
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from runlog.schemas import _codec as codec
from runlog.schemas._models import Event
from runlog.schemas._signing import (
    decision_message,
    generate_key_pair,
    load_signer,
    parse_public_keys,
)
from runlog.schemas._tenant_mac import TenantKeys, parse_tenant_keys
from runlog.schemas._vocabulary import EventType


def _per_op_us(fn: Callable[[], object], n: int, repeats: int = 5) -> float:
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(runs)


def _event(content_bytes: int) -> Event:
    return codec.build_event(
        EventType.TOOL_CALL_COMPLETED,
        {
            "call_id": "c1",
            "name": "lookup",
            "started_seq": 4,
            "content": "x" * content_bytes,
            "idempotency_key": "k" * 64,
        },
        run_id="r01a2338824a26c63bda29ea43731",
        tenant="tenant-a",
        seq=5,
        epoch=1,
        writer_id="bench",
        event_id="e" * 32,
        occurred_at=datetime.now(UTC),
    )


def _record_costs(
    keys: TenantKeys, ev: Event, key: bytes, value: bytes, headers: Any, n: int
) -> dict[str, float]:
    mac = keys.header("tenant-a", key, value)
    assert mac is not None
    return {
        "bytes": float(len(value)),
        "header_bytes": float(len(mac[0]) + len(mac[1])),
        "encode_us": _per_op_us(lambda: codec.encode(ev), n),
        "mac_us": _per_op_us(lambda: keys.header("tenant-a", key, value), n),
        "decode_us": _per_op_us(lambda: codec.decode(value), n),
        "check_us": _per_op_us(lambda: keys.check("tenant-a", key, value, headers), n),
    }


def measure(n: int = 2000) -> dict[str, dict[str, float]]:
    secret = base64.b64encode(os.urandom(32)).decode()
    keys = parse_tenant_keys(f"tenant-a a-1 {secret}\n")
    out: dict[str, dict[str, float]] = {}
    for label, size in (("300 B record", 100), ("16 KiB record", 16_000)):
        ev = _event(size)
        value = codec.encode(ev)
        key = ev.run_id.encode()
        header = keys.header("tenant-a", key, value)
        assert header is not None
        headers = [*codec.headers(ev), header]
        assert keys.check("tenant-a", key, value, headers) is None
        out[label] = _record_costs(keys, ev, key, value, headers, n)
    private, public = generate_key_pair("bench")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(private)
        signer = load_signer(path)
    authority = parse_public_keys(public)
    msg = decision_message(
        run_id="r01a2338824a26c63bda29ea43731",
        tenant="tenant-a",
        approval_id="ap-0123456789ab",
        approved=True,
        decided_by="ops",
        note="checked the ledger",
        decided_at=datetime.now(UTC).isoformat(),
    )
    sig = signer.sign(msg)
    out["decision"] = {
        "sign_us": _per_op_us(lambda: signer.sign(msg), n // 4),
        "verify_us": _per_op_us(lambda: authority.verdict(msg, "bench", sig), n // 4),
    }
    return out


def report(results: dict[str, dict[str, float]]) -> str:
    lines = ["integrity checks, CPU per operation (median of 5 repeats)"]
    for label, r in results.items():
        if label == "decision":
            lines.append(
                f"  decision signature (Ed25519): sign {r['sign_us']:.1f} us (decider, once), "
                f"verify {r['verify_us']:.1f} us (each reader, per APPROVAL_DECIDED only)"
            )
            continue
        lines.append(
            f"  {label} ({r['bytes']:.0f} B encoded): writer encode {r['encode_us']:.1f} us "
            f"+ MAC {r['mac_us']:.1f} us ({r['mac_us'] / r['encode_us']:.0%}); reader decode "
            f"{r['decode_us']:.1f} us + check {r['check_us']:.1f} us "
            f"({r['check_us'] / r['decode_us']:.0%}); header +{r['header_bytes']:.0f} B"
        )
    return "\n".join(lines)
