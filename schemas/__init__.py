"""Event vocabulary, Avro schemas of every released version, codec and upcasters."""

from schemas.codec import decode, encode, headers, make_payload, new_event_id, now_utc
from schemas.models import PAYLOAD_MODELS, Event, Payload
from schemas.vocabulary import RECORD_ONLY, STATE_CHANGING, EventType, classify

__all__ = [
    "PAYLOAD_MODELS",
    "RECORD_ONLY",
    "STATE_CHANGING",
    "Event",
    "EventType",
    "Payload",
    "classify",
    "decode",
    "encode",
    "headers",
    "make_payload",
    "new_event_id",
    "now_utc",
]
