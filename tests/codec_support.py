"""Records a hostile or buggy writer could put on the topic: encoded without the model check."""

from __future__ import annotations

import io
from typing import Any

import fastavro

from runlog.schemas import codec
from runlog.schemas.models import Event


def encode_unchecked(ev: Event, *, payload: dict[str, Any] | None = None, **envelope: Any) -> bytes:
    """``ev`` encoded with its real schema, ``envelope`` and ``payload`` fields overridden."""
    ws = codec.registry().writer(ev.type)
    rec = {
        "event_id": ev.event_id,
        "run_id": ev.run_id,
        "tenant": ev.tenant,
        "seq": ev.seq,
        "epoch": ev.epoch,
        "type": ev.type.value,
        "schema_version": ev.schema_version,
        "occurred_at": ev.occurred_at,
        "writer_id": ev.writer_id,
        "payload": {**ev.payload.model_dump(mode="python"), **(payload or {})},
        **envelope,
    }
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, ws.parsed, rec)
    return codec.MAGIC + ws.fingerprint + buf.getvalue()
