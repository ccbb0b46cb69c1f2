"""Schema ids from a Confluent-compatible schema registry, for Confluent's wire format.

Subjects follow Confluent's TopicRecordNameStrategy, one per event type:
``<events topic>-runlog.events.<Record>``. One subject per type (rather than one subject
holding a union of every type) keeps each type's history and its BACKWARD compatibility
check separate, so releasing v3 of one type never re-checks the others, and a consumer's
``AvroDeserializer`` gets a plain record schema, not a union to unwrap.

``runlog schemas register`` registers every released version in order, after setting the
subject's compatibility to BACKWARD: the registry refuses an incompatible version with
HTTP 409. Writers only look ids up (cached for the process): a writer never registers, so
an unreleased schema can never reach the topic. Ids are cached both ways; a registry that
does not answer raises ``RegistryUnavailable``, and the writer stops instead of falling
back to another encoding mid-run.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import fastavro

from runlog._settings import Settings
from runlog.errors import RegistryUnavailable, SchemaError, UnknownSchemaId
from runlog.schemas._registry import WriterSchema, fingerprint_of, registry, released
from runlog.schemas._vocabulary import EventType

COMPATIBILITY = "BACKWARD"


def subject_for(topic: str, event_type: EventType) -> str:
    ws = registry().writer(event_type)
    name = ws.parsed["name"] if isinstance(ws.parsed, dict) else str(event_type.value)
    return f"{topic}-{name}"


def _client(url: str, auth: str | None, timeout_s: float) -> Any:
    # The registry client is an optional dependency (extra ``registry``): import it here.
    try:
        from confluent_kafka.schema_registry import SchemaRegistryClient
    except ImportError as exc:  # pragma: no cover - depends on the installed extras
        raise RegistryUnavailable(
            "a schema registry is configured but its client is not installed: "
            "pip install 'runlog[registry]'"
        ) from exc
    # The client's default is no timeout at all: a registry that accepted the connection
    # and never answers would hold its caller forever, with nothing logged.
    conf: dict[str, Any] = {"url": url, "timeout": timeout_s}
    if auth:
        conf["basic.auth.user.info"] = auth
    return SchemaRegistryClient(conf)


def _schema(raw: Any) -> Any:
    from confluent_kafka.schema_registry import Schema

    return Schema(json.dumps(raw, sort_keys=True), "AVRO")


class RegistryIds:
    """``SchemaIds`` backed by a registry; thread-safe, one per process and topic."""

    def __init__(
        self, url: str, topic: str, *, auth: str | None = None, timeout_ms: int = 10_000
    ) -> None:
        self.url, self.topic = url, topic
        self._client = _client(url, auth, timeout_ms / 1000)
        self._lock = threading.Lock()
        self._ids: dict[tuple[EventType, int], int] = {}
        self._schemas: dict[int, WriterSchema] = {}

    def _call(self, what: str, fn: Any, *args: Any) -> Any:
        from confluent_kafka.schema_registry.error import SchemaRegistryError

        try:
            return fn(*args)
        except SchemaRegistryError as exc:
            if exc.http_status_code in (404, 409, 422):
                raise
            raise RegistryUnavailable(f"schema registry at {self.url}: {what}: {exc}") from exc
        except Exception as exc:
            raise RegistryUnavailable(f"schema registry at {self.url}: {what}: {exc}") from exc

    def id_for(self, schema: WriterSchema) -> int:
        key = (schema.event_type, schema.version)
        with self._lock:
            found = self._ids.get(key)
        if found is not None:
            return found
        from confluent_kafka.schema_registry.error import SchemaRegistryError

        subject = subject_for(self.topic, schema.event_type)
        try:
            got = self._call(
                f"looking up {subject}",
                self._client.lookup_schema,
                subject,
                _schema(_raw(schema.event_type, schema.version)),
            )
        except SchemaRegistryError as exc:
            raise RegistryUnavailable(
                f"{schema.event_type.value} v{schema.version} is not registered under "
                f"{subject} at {self.url}: run `runlog schemas register` ({exc})"
            ) from exc
        with self._lock:
            self._ids[key] = int(got.schema_id)
            self._schemas[int(got.schema_id)] = schema
        return int(got.schema_id)

    def schema_for(self, schema_id: int) -> WriterSchema:
        with self._lock:
            found = self._schemas.get(schema_id)
        if found is not None:
            return found
        from confluent_kafka.schema_registry.error import SchemaRegistryError

        try:
            got = self._call(f"schema id {schema_id}", self._client.get_schema, schema_id)
        except SchemaRegistryError as exc:
            raise UnknownSchemaId(f"schema id {schema_id} is unknown to {self.url}") from exc
        try:
            fp = fingerprint_of(fastavro.parse_schema(json.loads(got.schema_str)))
        except Exception as exc:
            raise UnknownSchemaId(f"schema id {schema_id} is not an Avro schema: {exc}") from exc
        ws = registry().by_fingerprint.get(fp)
        if ws is None:
            raise UnknownSchemaId(
                f"schema id {schema_id} at {self.url} is not one of runlog's released schemas"
            )
        with self._lock:
            self._schemas[schema_id] = ws
            self._ids.setdefault((ws.event_type, ws.version), schema_id)
        return ws

    def register_all(self) -> list[tuple[str, int, int]]:
        """Register every released version, oldest first; ``(subject, version, id)`` each.

        Idempotent: a schema already registered keeps its id. An incompatible version is
        refused by the registry (``SchemaError`` naming the subject and version).
        """
        from confluent_kafka.schema_registry.error import SchemaRegistryError

        done: list[tuple[str, int, int]] = []
        for et, version, raw in sorted(released(), key=lambda t: (t[0].value, t[1])):
            subject = subject_for(self.topic, et)
            if version == 1:
                self._call(
                    f"compatibility of {subject}",
                    self._client.set_compatibility,
                    subject,
                    COMPATIBILITY,
                )
            try:
                sid = self._call(
                    f"registering {subject}", self._client.register_schema, subject, _schema(raw)
                )
            except SchemaRegistryError as exc:
                raise SchemaError(
                    f"{subject} v{version} refused by the registry ({exc.http_status_code}): "
                    f"{exc.error_message}"
                ) from exc
            done.append((subject, version, int(sid)))
        return done


def _raw(event_type: EventType, version: int) -> Any:
    for et, v, raw in released():
        if et is event_type and v == version:
            return raw
    raise KeyError((event_type, version))  # pragma: no cover - registry() checked the set


_shared: dict[tuple[str, str], RegistryIds] = {}
_shared_lock = threading.Lock()


def ids_for(settings: Settings) -> RegistryIds | None:
    """The process's schema ids for ``settings``; None when no registry is configured."""
    if not settings.schema_registry_url:
        return None
    key = (settings.schema_registry_url, settings.events_topic)
    # One per (url, topic): the first settings' auth and timeout stand for the process.
    with _shared_lock:
        ids = _shared.get(key)
        if ids is None:
            auth = settings.schema_registry_auth
            ids = _shared[key] = RegistryIds(
                settings.schema_registry_url,
                settings.events_topic,
                auth=auth.get_secret_value() if auth else None,
                timeout_ms=settings.schema_registry_timeout_ms,
            )
        return ids
