"""Events built the way a writer builds them, and records a hostile or buggy writer could put
on the topic (encoded without the model check)."""

from __future__ import annotations

import io
from datetime import datetime
from typing import Any

import fastavro

from runlog.schemas import _codec as codec
from runlog.schemas._models import Event, Payload
from runlog.schemas._vocabulary import EventType


def make_event(
    et: EventType,
    payload: Payload | dict[str, Any] | None = None,
    *,
    run_id: str,
    seq: int,
    epoch: int = 1,
    tenant: str = "t",
    writer_id: str = "w",
    event_id: str | None = None,
    occurred_at: datetime | None = None,
) -> Event:
    """An event of the type's current schema version with its payload validated; a fresh
    event id and the current time unless given."""
    return codec.build_event(
        et,
        payload,
        run_id=run_id,
        tenant=tenant,
        seq=seq,
        epoch=epoch,
        writer_id=writer_id,
        event_id=event_id,
        occurred_at=occurred_at,
    )


def encode_unchecked(ev: Event, *, payload: dict[str, Any] | None = None, **envelope: Any) -> bytes:
    """``ev`` encoded with its real schema, ``envelope`` and ``payload`` fields overridden."""
    ws = codec.registry().writer(ev.type)
    base = codec.avro_record(ev)
    rec = {**base, "payload": {**base["payload"], **(payload or {})}, **envelope}
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, ws.parsed, rec)
    return codec.MAGIC + ws.fingerprint + buf.getvalue()
