"""Every event of a type's current schema version is built here: by a run's writer, and
outside one by test logs, benchmark workloads and the load generator.

The payload is always validated (it is the caller's input). The envelope is validated too,
unless ``trusted``: a writer makes it from values it owns, and skips the second check.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from runlog.schemas import codec
from runlog.schemas.models import Event, Payload
from runlog.schemas.vocabulary import EventType


def build_event(
    et: EventType,
    payload: Payload | dict[str, Any] | None = None,
    *,
    run_id: str,
    tenant: str,
    seq: int,
    epoch: int,
    writer_id: str,
    event_id: str | None = None,
    occurred_at: datetime | None = None,
    trusted: bool = False,
) -> Event:
    """An event of the type's current schema version with its payload validated; a fresh
    event id and the current time unless given."""
    values: dict[str, Any] = {
        "event_id": event_id or codec.new_event_id(),
        "run_id": run_id,
        "tenant": tenant,
        "seq": seq,
        "epoch": epoch,
        "type": et,
        "schema_version": codec.registry().current[et],
        "occurred_at": occurred_at or codec.now_utc(),
        "writer_id": writer_id,
        "payload": codec.make_payload(et, {} if payload is None else payload),
    }
    return codec.trusted_event(values) if trusted else Event.model_validate(values)
