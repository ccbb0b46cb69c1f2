"""The encodings of an event on the events topic, and the Kafka headers that travel with it.

Two framings of the same Avro binary body; every reader accepts both, so a topic can move
from one to the other without a rewrite:

* single-object encoding (the default, no server needed): ``C3 01`` + the 8-byte
  CRC-64-AVRO fingerprint (little-endian) of the writer schema, which names the exact
  ``.avsc`` file that wrote the record;
* Confluent's wire format (with a schema registry): ``00`` + the 4-byte big-endian schema
  id the registry gave that ``.avsc`` file, which is what Kafka Connect, ksqlDB, Flink,
  Spark and confluent-kafka's ``AvroDeserializer`` read. A ``SchemaIds`` maps ids to
  runlog's schemas and back (``runlog.log._registry`` asks the registry).
"""

from __future__ import annotations

import io
import itertools
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

import fastavro
from pydantic import ValidationError

from runlog.errors import (
    CorruptRecord,
    MissingUpcaster,
    NewerSchemaVersion,
    SchemaError,
    UnknownFingerprint,
    UnknownSchemaId,
    UpcastFailed,
    ValidationFailed,
)
from runlog.schemas import _compiled as compiled
from runlog.schemas._evolution import COMPATIBLE_STEPS, UPCASTERS
from runlog.schemas._models import PAYLOAD_MODELS, Event, Payload
from runlog.schemas._registry import WriterSchema, registry
from runlog.schemas._sealing import (
    SEALED_FIELDS,
    SEALED_SINCE,
    Opener,
    Sealer,
    View,
    open_record,
    plain_view,
    seal_payload,
    seal_record,
    top_level,
)

__all__ = ["decode", "encode", "headers", "make_payload", "registry"]
from runlog.schemas._vocabulary import EventType, parse_event_type

MAGIC = b"\xc3\x01"
HEADER_LEN = 10
CONFLUENT_MAGIC = 0
CONFLUENT_HEADER_LEN = 5


class SchemaIds(Protocol):
    """Confluent schema ids of runlog's released schemas, both ways."""

    def id_for(self, schema: WriterSchema) -> int:
        """The registry's id of ``schema``; raises if the registry does not hold it."""
        ...

    def schema_for(self, schema_id: int) -> WriterSchema:
        """The released schema the registry's ``schema_id`` is; raises ``SchemaError``."""
        ...


H_TYPE = "runlog.type"
H_FINGERPRINT = "runlog.fingerprint"
H_SEQ = "runlog.seq"
H_EPOCH = "runlog.epoch"
H_VERSION = "runlog.version"

# The envelope fields every version of every type starts with, in wire order. Used to
# say *which* newer type/version wrote a record whose fingerprint we do not know.
_ENVELOPE_PREFIX = fastavro.parse_schema(
    {
        "type": "record",
        "name": "runlog.EnvelopePrefix",
        "fields": [
            {"name": "event_id", "type": "string"},
            {"name": "run_id", "type": "string"},
            {"name": "tenant", "type": "string"},
            {"name": "seq", "type": "long"},
            {"name": "epoch", "type": "long"},
            {"name": "type", "type": "string"},
            {"name": "schema_version", "type": "int"},
        ],
    }
)


def now_utc() -> datetime:
    """Current time in UTC, truncated to microseconds (what Avro timestamp-micros keeps)."""
    return datetime.now(UTC)


_ids: tuple[int, str, itertools.count[int]] | None = None


def new_event_id() -> str:
    """A 32-hex-digit id unique across processes: a random per-process prefix + a counter.

    uuid4 costs an ``os.urandom`` system call per event, a measurable share of an append;
    128 random bits once per process plus a counter are as unique. A forked child draws
    its own prefix.
    """
    global _ids
    pid = os.getpid()
    if _ids is None or _ids[0] != pid:
        _ids = (pid, os.urandom(8).hex(), itertools.count())
    return f"{_ids[1]}{next(_ids[2]):016x}"


_construct = compiled.constructor(Event, list(Event.model_fields))
if _construct is None:
    raise TypeError("Event must stay constructible without validation (see compiled)")
_construct_event = _construct


def trusted_event(values: dict[str, Any]) -> Event:
    """An ``Event`` of envelope values its writer made itself and a validated payload.

    ``values`` names every field in declaration order. Nothing is validated again: what
    ``Event.model_construct`` does, without its per-field default and alias lookups.
    """
    event: Event = _construct_event(values)
    return event


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
    """An event of the type's current schema version: every event is built here, by a
    run's writer and outside one (test logs, benchmark workloads, the load generator).

    The payload is always validated (it is the caller's input). The envelope is too,
    unless ``trusted``: a writer makes it from values it owns and skips the second check.
    A fresh event id and the current time unless given.
    """
    values: dict[str, Any] = {
        "event_id": event_id or new_event_id(),
        "run_id": run_id,
        "tenant": tenant,
        "seq": seq,
        "epoch": epoch,
        "type": et,
        "schema_version": registry().current[et],
        "occurred_at": occurred_at or now_utc(),
        "writer_id": writer_id,
        "payload": make_payload(et, {} if payload is None else payload),
    }
    return trusted_event(values) if trusted else Event.model_validate(values)


def make_payload(event_type: EventType, payload: Payload | dict[str, Any]) -> Payload:
    """Validate ``payload`` against the type's current model; ``ValidationFailed`` names why."""
    model = PAYLOAD_MODELS[event_type]
    if isinstance(payload, model):
        return payload
    if isinstance(payload, Payload):
        raise ValidationFailed(
            f"{event_type.value}: expected {model.__name__}, got {type(payload).__name__}"
        )
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        raise ValidationFailed(f"{event_type.value}: invalid payload: {exc}") from exc


def encode(event: Event, ids: SchemaIds | None = None, sealer: Sealer | None = None) -> bytes:
    """``event`` with the current schema of its type: single-object, or Confluent's framing
    with the registry's schema id when ``ids`` is given. With a ``sealer``, its content
    fields (``sealing.SEALED_FIELDS``) are written sealed; without, as plaintext.

    The type's compiled encoder (``compiled.compile_encoder``) writes it; a value that
    encoder does not take goes through fastavro, which writes it or names what does not fit."""
    ws, header = _framing(event, ids)
    paths = SEALED_FIELDS.get(event.type) if sealer is not None else None
    if ws.encoder is not None:
        out = bytearray(header)
        try:
            if paths:
                assert sealer is not None
                sealed = seal_payload(event.payload, paths, sealer, event.run_id, event.seq)
                ws.encoder(View(event, {"payload": sealed}), out)
            else:
                ws.encoder(event, out)
            return bytes(out)
        except Exception:  # noqa: BLE001 - fastavro's answer below stands
            pass
    return _with_fastavro(event, ws, header, sealer)


def encode_with_fastavro(
    event: Event, ids: SchemaIds | None = None, sealer: Sealer | None = None
) -> bytes:
    """``encode`` by fastavro alone: the reference the compiled encoders are checked against."""
    return _with_fastavro(event, *_framing(event, ids), sealer)


def _framing(event: Event, ids: SchemaIds | None) -> tuple[WriterSchema, bytes]:
    ws = registry().writers[event.type]
    if event.schema_version != ws.version:
        raise ValidationFailed(
            f"{event.type.value}: writers emit only the current version v{ws.version}, "
            f"not v{event.schema_version}"
        )
    if ids is None:
        return ws, MAGIC + ws.fingerprint
    return ws, bytes([CONFLUENT_MAGIC]) + ids.id_for(ws).to_bytes(4, "big")


def avro_record(event: Event) -> dict[str, Any]:
    """``event`` as fastavro writes it: the envelope's fields and the payload, as a dict."""
    return {
        "event_id": event.event_id,
        "run_id": event.run_id,
        "tenant": event.tenant,
        "seq": event.seq,
        "epoch": event.epoch,
        "type": event.type.value,
        "schema_version": event.schema_version,
        "occurred_at": event.occurred_at,
        "writer_id": event.writer_id,
        "payload": event.payload.model_dump(mode="python"),
    }


def _with_fastavro(
    event: Event, ws: WriterSchema, header: bytes, sealer: Sealer | None = None
) -> bytes:
    record = avro_record(event)
    paths = SEALED_FIELDS.get(event.type) if sealer is not None else None
    if paths:
        assert sealer is not None
        seal_record(record["payload"], paths, sealer, event.run_id, event.seq)
    buf = io.BytesIO()
    buf.write(header)
    try:
        fastavro.schemaless_writer(buf, ws.parsed, record)
    except (ValueError, TypeError) as exc:
        raise ValidationFailed(f"{event.type.value}: does not fit its Avro schema: {exc}") from exc
    return buf.getvalue()


def headers(event: Event) -> list[tuple[str, str | bytes | None]]:
    """Kafka headers: consumers can route or skip without decoding the value."""
    ws = registry().writers[event.type]
    return [
        (H_TYPE, event.type.value.encode()),
        (H_FINGERPRINT, ws.fingerprint),
        (H_SEQ, str(event.seq).encode()),
        (H_EPOCH, str(event.epoch).encode()),
        (H_VERSION, str(ws.version).encode()),
    ]


def _framed(data: bytes, ids: SchemaIds | None) -> tuple[WriterSchema, int]:
    """The schema that wrote ``data`` and where its Avro body starts, for either framing."""
    if data and data[0] == CONFLUENT_MAGIC:
        if len(data) < CONFLUENT_HEADER_LEN:
            raise CorruptRecord(f"record of {len(data)} bytes is shorter than the 5-byte header")
        schema_id = int.from_bytes(data[1:CONFLUENT_HEADER_LEN], "big")
        if ids is None:
            raise UnknownSchemaId(
                f"record is in Confluent's wire format (schema id {schema_id}) but no schema "
                "registry is configured (RUNLOG_SCHEMA_REGISTRY_URL)"
            )
        return ids.schema_for(schema_id), CONFLUENT_HEADER_LEN
    return writer_schema_of(data), HEADER_LEN


def writer_schema_of(data: bytes) -> WriterSchema:
    """The schema that wrote single-object ``data``; ``CorruptRecord`` / ``UnknownFingerprint``."""
    if data is None or len(data) < HEADER_LEN:
        size = 0 if data is None else len(data)
        raise CorruptRecord(f"record of {size} bytes is shorter than the 10-byte header")
    if data[:2] != MAGIC:
        raise CorruptRecord(f"bad single-object marker {data[:2].hex()} (expected c301)")
    fp = bytes(data[2:HEADER_LEN])
    ws = registry().by_fingerprint.get(fp)
    if ws is None:
        raise _unknown(fp, data)
    return ws


def _unknown(fp: bytes, data: bytes) -> SchemaError:
    """The most precise error for an unknown fingerprint."""
    try:
        prefix: Any = fastavro.schemaless_reader(io.BytesIO(data[HEADER_LEN:]), _ENVELOPE_PREFIX)
        et = EventType(prefix["type"])
        version = int(prefix["schema_version"])
    except Exception:  # noqa: BLE001 - any failure means we cannot say more than "unknown"
        return UnknownFingerprint(fp)
    known = registry().current[et]
    if version > known:
        return NewerSchemaVersion(
            f"{et.value} v{version} was written by a newer release; this reader knows "
            f"up to v{known} (fingerprint {fp.hex()})"
        )
    return UnknownFingerprint(fp)


def _read(data: bytes, writer: Any, reader: Any | None = None) -> dict[str, Any]:
    try:
        rec = fastavro.schemaless_reader(io.BytesIO(data), writer, reader)
    except Exception as exc:  # fastavro raises many types for bad bytes
        raise CorruptRecord(f"Avro body does not decode: {type(exc).__name__}: {exc}") from exc
    if not isinstance(rec, dict):  # pragma: no cover - schemas are records
        raise CorruptRecord("Avro body is not a record")
    return rec


def _upgrade(ws: WriterSchema, record: dict[str, Any]) -> dict[str, Any]:
    """Walk ``record`` from ``ws.version`` up to the current version, step by step."""
    reg = registry()
    version = ws.version
    target = reg.current[ws.event_type]
    while version < target:
        step = (ws.event_type, version)
        nxt = reg.writer(ws.event_type, version + 1)
        if step in UPCASTERS:
            record = dict(record)
            try:
                record["payload"] = UPCASTERS[step](dict(record["payload"]))
            except Exception as exc:  # any upcaster bug is this record's problem
                # A reader must quarantine the record (or name it), never crash on it.
                raise UpcastFailed(
                    f"{ws.event_type.value}: upcaster v{version} -> v{version + 1} failed: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
        elif step in COMPATIBLE_STEPS:
            # Re-encode with vN and resolve into vN+1: exactly Avro's resolution rules.
            buf = io.BytesIO()
            try:
                fastavro.schemaless_writer(buf, reg.writer(ws.event_type, version).parsed, record)
            except Exception as exc:  # an earlier upcast can make it unencodable
                raise UpcastFailed(
                    f"{ws.event_type.value}: v{version} record does not re-encode for "
                    f"resolution into v{version + 1}: {type(exc).__name__}: {exc}"
                ) from exc
            record = _read(buf.getvalue(), reg.writer(ws.event_type, version).parsed, nxt.parsed)
        else:
            raise MissingUpcaster(
                f"{ws.event_type.value}: no upcaster or compatibility rule for "
                f"v{version} -> v{version + 1}; refusing to guess its meaning"
            )
        version += 1
        record["schema_version"] = version
    return record


@dataclass(frozen=True)
class _Compiled:
    """A current writer schema's compiled reader and the checks its values still need."""

    read: compiled.Reader
    payload: compiled.Check | None
    """Builds the payload model; None: pydantic validates it (``make_payload``)."""
    envelope: Callable[[dict[str, Any]], None]
    """Checks what the schema does not prove of the envelope (``compiled.compile_checks``)."""
    event: compiled.Check
    type_name: str
    """The event type's wire name, as each record must repeat it."""
    schema: WriterSchema
    sealed: tuple[str, ...]
    """The content fields that may hold sealed values (empty: none)."""
    plain_unless: tuple[str, ...] | None
    """When every sealed field is a top-level one: those fields, a record whose values
    there are all strings (or null) holding nothing sealed; None: a nested one may."""

    def holds_sealed(self, payload: dict[str, Any]) -> bool:
        """Whether ``payload`` may hold a sealed value (a plaintext record need not visit
        the sealing code: a sealed value is the one kind of dict these fields take)."""
        top = self.plain_unless
        if top is None:
            return bool(self.sealed)
        for name in top:  # noqa: SIM110 - a loop: any() adds a generator per record
            if isinstance(payload.get(name), dict):
                return True
        return False


def _paths(ws: WriterSchema) -> tuple[str, ...]:
    """The content fields of ``ws`` that may be sealed: none before its sealed version."""
    since = SEALED_SINCE.get(ws.event_type)
    return SEALED_FIELDS[ws.event_type] if since is not None and ws.version >= since else ()


def _open(
    et: EventType, paths: tuple[str, ...], record: dict[str, Any], opener: Opener | None
) -> None:
    try:
        open_record(record["payload"], paths, opener, record["run_id"], record["seq"])
    except ValueError as exc:  # InvalidTag and friends: the value is not what was sealed
        raise CorruptRecord(f"{et.value}: a sealed field does not open: {exc!r}") from exc


_BY_HEADER: dict[bytes, _Compiled] = {}
"""Single-object header (marker + fingerprint) -> its compiled decoder: one lookup."""


_COMPILED: dict[bytes, _Compiled | None] = {}
_COMPILING = threading.Lock()


def _compiled(ws: WriterSchema) -> _Compiled | None:
    """The compiled decoder of ``ws`` (cached); None for an older version (those are
    upcast, through fastavro) or a schema the compiler does not cover. Compiled by one
    thread: a burst of opens that each read a log would otherwise each compile it, holding
    the interpreter's lock in ``compile`` (see ``registry``)."""
    if ws.fingerprint in _COMPILED:
        return _COMPILED[ws.fingerprint]
    with _COMPILING:
        if ws.fingerprint not in _COMPILED:
            _COMPILED[ws.fingerprint] = _compile_decoder(ws)
        return _COMPILED[ws.fingerprint]


def _compile_decoder(ws: WriterSchema) -> _Compiled | None:
    out: _Compiled | None = None
    if ws.version == registry().current[ws.event_type]:
        fields = {f["name"]: f["type"] for f in ws.parsed["fields"]}
        envelope = compiled.field_checks(Event, fields, skip=frozenset({"type", "payload"}))
        if envelope is not None:
            # Compared with the schema's own version below: its bounds hold already.
            envelope = [(name, check) for name, check in envelope if name != "schema_version"]
        try:
            read = compiled.compile_reader(ws.parsed)
        except NotImplementedError:
            envelope = None
        event = compiled.constructor(Event, list(fields))
        if envelope is not None and event is not None:
            model = PAYLOAD_MODELS[ws.event_type]
            # Sealed values are opened before the payload is built: it reads plaintext.
            payload = compiled.builder(model, plain_view(fields["payload"]))
            checks = compiled.compile_checks("Event", envelope)
            paths = _paths(ws)
            top = paths if top_level(paths) else None
            out = _Compiled(read, payload, checks, event, ws.event_type.value, ws, paths, top)
    return out


def warm_decoders() -> None:
    """Compile the decoder of every current schema now (tens of milliseconds, once a
    process), not at the first record of each type the process reads: a worker's first
    takeover of many runs would otherwise compile them on the threads opening those runs,
    holding the interpreter while the handovers wait."""
    reg = registry()
    for event_type in reg.current:
        _compiled(reg.writer(event_type))


def decode(data: bytes, ids: SchemaIds | None = None, opener: Opener | None = None) -> Event:
    """Decode one record into the current version of its event; ``SchemaError`` on failure.

    ``ids`` resolves Confluent-framed records; single-object records need nothing.
    ``opener`` opens sealed content fields (a destroyed key's open as ``sealing.ERASED``);
    a sealed record without one raises ``NoKeys``.
    """
    fast = _BY_HEADER.get(data[:HEADER_LEN]) if data else None
    if fast is not None:
        ws, body = fast.schema, HEADER_LEN
    else:
        ws, body = _framed(data, ids)
        fast = _compiled(ws)
        if fast is None:
            return _decode_slow(ws, data[body:], opener)
        if body == HEADER_LEN:
            _BY_HEADER[bytes(data[:HEADER_LEN])] = fast
    try:
        record, _ = fast.read(data, body)
    except Exception as exc:  # any failure of the bytes is this record's problem
        raise CorruptRecord(f"Avro body does not decode: {type(exc).__name__}: {exc}") from exc
    et = ws.event_type
    if fast.sealed and fast.holds_sealed(record["payload"]):
        _open(et, fast.sealed, record, opener)
    if record["type"] != fast.type_name:
        raise CorruptRecord(f"record says type {record['type']!r} but its schema is {et.value}")
    if record["schema_version"] != ws.version:
        raise CorruptRecord(
            f"record says v{record['schema_version']} but its schema is v{ws.version}"
        )
    if fast.payload is None:
        payload = make_payload(et, record["payload"])
    else:
        try:
            payload = fast.payload(record["payload"])
        except ValueError as exc:
            raise ValidationFailed(f"{et.value}: invalid payload: {exc}") from exc
    try:
        fast.envelope(record)
    except ValueError as exc:
        raise ValidationFailed(f"{et.value}: invalid envelope: {exc}") from exc
    record["type"] = et
    record["payload"] = payload
    event: Event = fast.event(record)
    return event


def _decode_slow(ws: WriterSchema, body: bytes, opener: Opener | None = None) -> Event:
    """fastavro and pydantic: older versions (upcast on the way) and uncompiled schemas."""
    record = _read(body, ws.parsed)
    paths = _paths(ws)
    if paths:
        _open(ws.event_type, paths, record, opener)
    if record.get("type") != ws.event_type.value:
        raise CorruptRecord(
            f"record says type {record.get('type')!r} but its schema is {ws.event_type.value}"
        )
    if record.get("schema_version") != ws.version:
        raise CorruptRecord(
            f"record says v{record.get('schema_version')} but its schema is v{ws.version}"
        )
    if ws.version != registry().current[ws.event_type]:
        record = _upgrade(ws, record)
    et = parse_event_type(record["type"])
    payload = make_payload(et, record["payload"])
    try:
        return Event(
            event_id=record["event_id"],
            run_id=record["run_id"],
            tenant=record["tenant"],
            seq=record["seq"],
            epoch=record["epoch"],
            type=et,
            schema_version=record["schema_version"],
            occurred_at=record["occurred_at"],
            writer_id=record["writer_id"],
            payload=payload,
        )
    except ValidationError as exc:
        raise ValidationFailed(f"{et.value}: invalid envelope: {exc}") from exc


def peek_header(data: bytes) -> tuple[EventType, int] | None:
    """Type and version from the fingerprint alone, without decoding; None if unknown."""
    if data is None or len(data) < HEADER_LEN or data[:2] != MAGIC:
        return None
    ws = registry().by_fingerprint.get(bytes(data[2:HEADER_LEN]))
    return None if ws is None else (ws.event_type, ws.version)
