"""Events built outside a run's writer: test logs, benchmark workloads, the load generator.

A writer builds its own envelope (``producers.run``); everything else that needs a valid
event of a type's current schema version builds it here, with the payload validated.
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
) -> Event:
    """An event of the type's current schema version with its payload validated; a fresh
    event id and the current time unless given."""
    return Event(
        event_id=event_id or codec.new_event_id(),
        run_id=run_id,
        tenant=tenant,
        seq=seq,
        epoch=epoch,
        type=et,
        schema_version=codec.registry().current[et],
        occurred_at=occurred_at or codec.now_utc(),
        writer_id=writer_id,
        payload=codec.make_payload(et, {} if payload is None else payload),
    )
