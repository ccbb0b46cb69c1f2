"""The run-lifecycle topic: a compacted, co-partitioned dispatch index keyed by run id.

Partition p of ``<prefix>.lifecycle`` names the runs that live in partition p of the
events topic (same count, same murmur2 placement of the run id). The latest record of a
run is its dispatch state; a finished run's record is a tombstone. The topic is a hint a
worker checks against the log (opening a run replays it), never a source of truth: see
docs/concepts/fleet.md for why dispatch reads it rather than the events or the run index.

A record's value is canonical JSON: ``{"v": 1, "state": ..., "tenant": ..., "agent": ...}``
plus ``input_json``, ``requested_by`` and ``requested_at`` (``requested``) or ``due_at``
(``waiting_until``, ISO UTC).

The record is a cache of the run's log: a record that disagrees with the log (another
tenant, another agent, a timer it does not name) is rebuilt from it (``rebuilt``), never
dropped.

With ``RUNLOG_ENCRYPTION=on`` a start request's ``input_json`` (the run's input: content)
is sealed under the run's data subject, as RUN_STARTED's is, and written as
``{"sealed": {"key_id": ..., "nonce": <base64>, "ciphertext": <base64>}}``: AES-256-GCM
of the input's UTF-8 text with the associated data ``aad(run_id, 0, "lifecycle.input_json")``
(``runlog.schemas._sealing.aad``; seq 0: no event has it). The record keeps it sealed in
memory; the worker opens it when it starts the run (``Record.open_input``), and after a
shred of the subject it opens to ``ERASED``.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from runlog._settings import Settings
from runlog.errors import ConfigError, KafkaUnavailable, NoKeys, SchemaError
from runlog.log._kafka import high_watermark, reader_config
from runlog.projections._run_state import RunState
from runlog.schemas._keys import partition_for
from runlog.schemas._sealing import ERASED, Opener, Sealed, Sealer, aad

State = Literal["requested", "open", "waiting_person", "waiting_until"]
STATES: tuple[State, ...] = ("requested", "open", "waiting_person", "waiting_until")
DISPATCHABLE: frozenset[str] = frozenset({"requested", "open"})
FORMAT = 1
POLL_SLICE_S = 0.005
"""How long a write's wait polls the producer at a time (``LifecycleWriter.write``)."""
INPUT_FIELD = "lifecycle.input_json"
"""The field name in a sealed start input's associated data (with the run id and seq 0)."""


def input_aad(run_id: str) -> bytes:
    return aad(run_id, 0, INPUT_FIELD)


def topic(settings: Settings) -> str:
    return settings.lifecycle_topic


def group(settings: Settings) -> str:
    return settings.fleet_group


@dataclass(frozen=True)
class Record:
    """One run's dispatch state (the value of its latest lifecycle record)."""

    state: State
    tenant: str
    agent: str
    input_json: str | None = None
    due_at: datetime | None = None
    subject: str | None = None
    """A start request's data subject (``runlog.start(subject=...)``), for its RUN_STARTED."""
    input_sealed: Sealed | None = None
    """The start input as read, still sealed (``input_json`` is then None): see
    ``open_input``."""
    requested_by: str | None = None
    """Who asked for the start (``runlog start``: user@host), shown while no log exists."""
    requested_at: datetime | None = None
    """When the start was asked for (UTC)."""

    def encode(self, sealer: Sealer | None = None, run_id: str = "") -> bytes:
        """The record's value; with a ``sealer`` (the run's subject's), its input sealed."""
        body: dict[str, Any] = {
            "v": FORMAT,
            "state": self.state,
            "tenant": self.tenant,
            "agent": self.agent,
        }
        if self.input_json is not None and sealer is not None:
            sealed = sealer.seal(self.input_json, input_aad(run_id))
            body["input_json"] = {
                "sealed": {
                    "key_id": sealed.key_id,
                    "nonce": base64.b64encode(sealed.nonce).decode(),
                    "ciphertext": base64.b64encode(sealed.ciphertext).decode(),
                }
            }
        elif self.input_json is not None:
            body["input_json"] = self.input_json
        elif self.input_sealed is not None:
            raise ValueError("a sealed start input is written by the request, never copied")
        if self.due_at is not None:
            body["due_at"] = self.due_at.isoformat()
        if self.subject is not None:
            body["subject"] = self.subject
        if self.requested_by is not None:
            body["requested_by"] = self.requested_by
        if self.requested_at is not None:
            body["requested_at"] = self.requested_at.isoformat()
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, value: bytes) -> Record:
        try:
            body = json.loads(value)
            if body.get("v") != FORMAT or body.get("state") not in STATES:
                raise ValueError(f"unknown lifecycle record {body.get('v')}/{body.get('state')}")
            due = body.get("due_at")
            asked = body.get("requested_at")
            given = body.get("input_json")
            sealed = None
            if isinstance(given, dict):
                env = given["sealed"]
                sealed = Sealed(
                    str(env["key_id"]),
                    base64.b64decode(env["nonce"], validate=True),
                    base64.b64decode(env["ciphertext"], validate=True),
                )
                given = None
            elif given is not None and not isinstance(given, str):
                raise ValueError(f"input_json is a {type(given).__name__}")
            return cls(
                state=body["state"],
                tenant=str(body["tenant"]),
                agent=str(body["agent"]),
                input_json=given,
                due_at=datetime.fromisoformat(due) if due else None,
                subject=body.get("subject"),
                input_sealed=sealed,
                requested_by=body.get("requested_by"),
                requested_at=datetime.fromisoformat(asked) if asked else None,
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise SchemaError(f"undecodable lifecycle record: {exc}") from exc

    def open_input(self, opener: Opener | None, run_id: str) -> str | None:
        """The start input in plaintext: as written, or opened with ``opener``; ``ERASED``
        when the subject's key was destroyed. Raises ``NoKeys`` (sealed, and no opener) or
        ``ValueError`` (does not authenticate for this run)."""
        if self.input_sealed is None:
            return self.input_json
        if opener is None:
            raise NoKeys(
                f"the start input of {run_id} is sealed under key {self.input_sealed.key_id!r} "
                "and this worker has no keys (RUNLOG_ENCRYPTION, RUNLOG_KEK)"
            )
        text = opener.open(*self.input_sealed, input_aad(run_id))
        return ERASED if text is None else text


def rebuilt(state: RunState, now: datetime) -> Record | None:
    """The lifecycle record the run's log implies (``state``: its fold), None for a
    tombstone: a run that ended (finished, erased) or that the registry did not start (no
    worker may run it) has none; a run asleep on a timer due after ``now`` waits for it; any
    other is ``open`` (dispatched: re-executing its agent finds every wait again). Tenant
    and agent are the log's. The rule a worker applies to a record that disagrees with the
    log, and a start request for a run that already has one."""
    if state.status in ("new", "finished") or state.erased is not None:
        return None
    if state.agent_name is None:
        return None
    if state.cancel is None and not state.pending_approvals and state.timers:
        due = state.timers[-1].due_at
        if due > now:
            return Record("waiting_until", state.tenant, state.agent_name, due_at=due)
    return Record("open", state.tenant, state.agent_name)


@dataclass(frozen=True)
class Latest:
    """A run's latest lifecycle record as read from the topic."""

    record: Record | None
    """None: a tombstone, or a value that does not decode (``error`` says why)."""
    offset: int
    written_at: datetime | None
    """The broker's timestamp of the record (UTC), when it has one."""
    error: str | None = None


def read_latest(
    settings: Settings, *, run_ids: frozenset[str] | None = None, wait_s: float = 30.0
) -> dict[str, Latest]:
    """Each run's latest lifecycle record, read from the topic (every partition, or only
    those of ``run_ids``; then only theirs are kept). Reads each partition to the high
    watermark it had when this call began: a record written after that is not seen."""
    name = topic(settings)
    parts = (
        range(settings.partitions)
        if run_ids is None
        else sorted({partition_for(r, settings.partitions) for r in run_ids})
    )
    consumer = Consumer(reader_config(settings))
    out: dict[str, Latest] = {}
    try:
        for part in parts:
            end = high_watermark(consumer, name, part)
            if end <= 0:
                continue
            consumer.assign([TopicPartition(name, part, OFFSET_BEGINNING)])
            deadline = time.monotonic() + wait_s
            done = False
            while not done:
                if time.monotonic() > deadline:
                    raise KafkaUnavailable(f"reading {name}[{part}] to {end} timed out")
                for msg in consumer.consume(500, timeout=0.5):
                    if msg.error() is not None:
                        continue
                    off = msg.offset() or 0
                    key = msg.key()
                    if key is not None and off < end:
                        rid = key.decode()
                        if run_ids is None or rid in run_ids:
                            out[rid] = _latest(msg.value(), off, msg.timestamp())
                    if off >= end - 1:
                        done = True
            consumer.unassign()
    finally:
        consumer.close()
    return out


def _latest(value: bytes | None, offset: int, stamp: tuple[int, int]) -> Latest:
    kind, ms = stamp
    at = None if kind == 0 or ms < 0 else datetime.fromtimestamp(ms / 1000, tz=UTC)
    if value is None:
        return Latest(None, offset, at)
    try:
        return Latest(Record.decode(value), offset, at)
    except SchemaError as exc:
        return Latest(None, offset, at, error=str(exc))


class LifecycleWriter:
    """Writes lifecycle records, each acknowledged (acks=all, idempotent) before it returns."""

    def __init__(self, settings: Settings) -> None:
        from confluent_kafka import Producer

        self.settings = settings
        self.topic = topic(settings)
        conf = settings.durable_producer_config({"linger.ms": 0})
        self._producer = Producer(conf)
        self._lock = threading.Lock()
        self._check_topic()

    def _check_topic(self) -> None:
        """A missing topic is a setup step not taken: said at once, not after the delivery
        timeout of the first request."""
        try:
            md = self._producer.list_topics(self.topic, timeout=10)
        except Exception as exc:
            raise KafkaUnavailable(f"describing {self.topic}: {exc}") from exc
        found = md.topics.get(self.topic)
        if found is None or found.error is not None:
            raise ConfigError(
                f"topic {self.topic} is missing: run `runlog topics create` (the fleet's "
                "lifecycle topic, docs/concepts/fleet.md)"
            )
        check_partitions(self.settings, len(found.partitions))

    def write(
        self,
        run_id: str,
        record: Record | None,
        *,
        timeout_s: float = 30.0,
        sealer: Sealer | None = None,
    ) -> int:
        """Produce ``record`` (None: a tombstone) for ``run_id``; returns its offset. With
        a ``sealer``, the record's input is written sealed (``Record.encode``)."""
        return self.write_value(
            run_id, None if record is None else record.encode(sealer, run_id), timeout_s=timeout_s
        )

    def write_value(
        self, run_id: str, value: bytes | None, *, timeout_s: float = 30.0, key: str | None = None
    ) -> int:
        """Produce ``value`` in ``run_id``'s partition under ``key`` (default: the run id;
        a request about the run, ``fleet.reconciling``, has a key of its own there, so it
        never replaces the run's dispatch record); returns its offset."""
        part = partition_for(run_id, self.settings.partitions)
        record_key = run_id if key is None else key
        done = threading.Event()
        got: dict[str, Any] = {}

        def report(err: Any, msg: Any) -> None:
            got["err"], got["offset"] = err, (msg.offset() if msg is not None else -1)
            done.set()

        with self._lock:
            try:
                self._producer.produce(
                    self.topic,
                    key=record_key.encode(),
                    value=value,
                    partition=part,
                    on_delivery=report,
                )
            except Exception as exc:  # BufferError, KafkaException
                raise KafkaUnavailable(f"lifecycle record of {run_id}: {exc}") from exc
        deadline = time.monotonic() + timeout_s
        while not done.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            # Threads writing at once share the producer, and another's poll may serve this
            # report while this one waits out its own: short slices, so a write returns
            # within a few ms of its acknowledgement, and a deadline by the clock (a poll
            # that returns early must not use up a poll's worth of it).
            self._producer.poll(min(POLL_SLICE_S, left))
        if not done.is_set():
            raise KafkaUnavailable(f"lifecycle record of {run_id} not acknowledged in {timeout_s}s")
        if got["err"] is not None:
            raise KafkaUnavailable(f"lifecycle record of {run_id} refused: {got['err']}")
        return int(got["offset"])

    def close(self) -> None:
        self._producer.flush(5)


_WRITERS: dict[str, LifecycleWriter] = {}
_WRITERS_LOCK = threading.Lock()


def writer_for(settings: Settings) -> LifecycleWriter:
    """One writer per process and settings (a producer is a connection pool)."""
    key = settings.fingerprint()
    with _WRITERS_LOCK:
        w = _WRITERS.get(key)
        if w is None:
            w = _WRITERS[key] = LifecycleWriter(settings)
        return w


def close_writers(bootstrap_servers: str | None = None) -> None:
    """Close the process's writers: all, or those whose settings name ``bootstrap_servers``
    (``Services.close_shared``, before that cluster goes away: no producer is left
    retrying it)."""
    with _WRITERS_LOCK:
        keys = [
            k
            for k, w in _WRITERS.items()
            if bootstrap_servers is None or w.settings.bootstrap_servers == bootstrap_servers
        ]
        closing = [_WRITERS.pop(k) for k in keys]
    for w in closing:
        w.close()


def check_partitions(settings: Settings, count: int) -> None:
    if count != settings.partitions:
        raise ConfigError(
            f"topic {topic(settings)} has {count} partitions but RUNLOG_PARTITIONS is "
            f"{settings.partitions}: the lifecycle topic must be co-partitioned with the events"
        )
