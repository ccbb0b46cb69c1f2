"""Read one run's events from the log, starting where the run starts.

Kafka cannot filter by key on the broker, so a reader seeks as close to the run's first
event as it can (an explicit position, the run's start index, or the run id's embedded
creation time with ``offsets_for_times``) and reads to the high watermark, decoding only
the records whose key is the run id.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import redis
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, TopicPartition

from runlog.errors import ConfigError, KafkaUnavailable, RedisUnavailable, SchemaError
from runlog.schemas.codec import decode
from runlog.schemas.keys import partition_for, run_id_time_ms, start_key
from runlog.schemas.models import Event
from runlog.settings import Settings

# How far before a run id's creation time to start looking: covers producer clock skew.
START_SKEW_MS = 60_000

# How long a lookup retries a retriable broker error (leader moving, metadata not yet
# propagated after topic creation) before reporting the broker unavailable.
RETRY_FOR_S = 10.0
# librdkafka reports these as plain error codes (``retriable()`` is False on them).
TRANSIENT = frozenset(
    {
        KafkaError.NOT_LEADER_FOR_PARTITION,
        KafkaError.LEADER_NOT_AVAILABLE,
        KafkaError.UNKNOWN_TOPIC_OR_PART,
        KafkaError.REQUEST_TIMED_OUT,
        KafkaError._TRANSPORT,
        KafkaError._TIMED_OUT,
        KafkaError._ALL_BROKERS_DOWN,
    }
)


T = TypeVar("T")


def _retrying(what: str, call: Callable[[], T]) -> T:
    """``call()``, retried with capped backoff while the broker says the error is transient."""
    deadline = time.monotonic() + RETRY_FOR_S
    delay = 0.05
    while True:
        try:
            return call()
        except KafkaException as exc:
            err = exc.args[0] if exc.args else None
            retriable = isinstance(err, KafkaError) and (err.retriable() or err.code() in TRANSIENT)
            if not retriable or time.monotonic() + delay > deadline:
                raise KafkaUnavailable(f"{what}: {exc}") from exc
        time.sleep(delay)
        delay = min(delay * 2, 1.0)


@dataclass(frozen=True)
class Position:
    partition: int
    offset: int


@dataclass(frozen=True)
class LogRecord:
    event: Event
    partition: int
    offset: int


def consumer_config(settings: Settings, **extra: Any) -> dict[str, Any]:
    conf = dict(settings.kafka_common())
    conf.update(
        {
            "group.id": f"runlog-reader-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "auto.offset.reset": "earliest",
            # Catch-up readers: do not pay librdkafka's 500 ms default wait per fetch.
            "fetch.wait.max.ms": 10,
            "enable.partition.eof": True,
            "isolation.level": "read_committed",
        }
    )
    conf.update(extra)
    return conf


class LogReader:
    """Reads runs' events. Not thread-safe; cheap to create per replay."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.topic = settings.events_topic
        self._consumer = Consumer(consumer_config(settings))
        self._partitions: int | None = None

    def close(self) -> None:
        self._consumer.close()

    def __enter__(self) -> LogReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def partition_count(self) -> int:
        if self._partitions is None:
            try:
                md = self._consumer.list_topics(self.topic, timeout=10)
            except KafkaException as exc:
                raise KafkaUnavailable(f"metadata for {self.topic}: {exc}") from exc
            tmd = md.topics.get(self.topic)
            if tmd is None or tmd.error is not None or not tmd.partitions:
                raise KafkaUnavailable(f"topic {self.topic} not found (run `runlog topics create`)")
            self._partitions = len(tmd.partitions)
        return self._partitions

    def partition_of(self, run_id: str) -> int:
        return partition_for(run_id, self.partition_count())

    def high_watermark(self, partition: int) -> int:
        tp = TopicPartition(self.topic, partition)
        _, high = _retrying(
            f"watermarks of {self.topic}[{partition}]",
            lambda: self._consumer.get_watermark_offsets(tp, timeout=10, cached=False),
        )
        return int(high)

    def start_offset(self, run_id: str, partition: int, hint: int | None = None) -> int:
        """Best known offset at or before the run's first event."""
        if hint is not None:
            return hint
        created = run_id_time_ms(run_id)
        if created is not None:
            tp = TopicPartition(self.topic, partition, max(0, created - START_SKEW_MS))
            (found,) = _retrying(
                "offsets_for_times", lambda: self._consumer.offsets_for_times([tp], timeout=10)
            )
            if found.offset >= 0:
                return int(found.offset)
            # No record at or after that time: the run has no events yet.
            return self.high_watermark(partition)
        return OFFSET_BEGINNING

    def read(
        self,
        run_id: str,
        *,
        partition: int | None = None,
        start: int | None = None,
        end: int | None = None,
    ) -> Iterator[LogRecord]:
        """Events of ``run_id`` in log order, from ``start`` up to (excluding) ``end``.

        ``end`` defaults to the high watermark when the read begins. A record of this run
        that does not decode raises ``SchemaError`` naming its offset: a writer must never
        resume past a fact it cannot read.
        """
        part = self.partition_of(run_id) if partition is None else partition
        stop = self.high_watermark(part) if end is None else end
        offset = self.start_offset(run_id, part, start)
        if stop == 0 or (offset != OFFSET_BEGINNING and offset >= stop):
            return
        key = run_id.encode()
        self._consumer.assign([TopicPartition(self.topic, part, offset)])
        nxt = offset if offset >= 0 else None
        try:
            while True:
                # consume() waits its whole timeout unless the batch fills, even at the end
                # of the partition: ask for no more than the records left before ``stop``,
                # so a short replay (every open_run's read-back) returns at once.
                want = 500 if nxt is None else max(1, min(500, stop - nxt))
                batch = self._consumer.consume(want, timeout=1.0)
                for msg in batch:
                    err = msg.error()
                    off = msg.offset()
                    assert off is not None  # consumed messages and EOF events carry one
                    if err is not None:
                        if err.code() == err._PARTITION_EOF:
                            if off >= stop:
                                return
                            continue
                        raise KafkaUnavailable(f"reading {self.topic}[{part}]: {err}")
                    if off >= stop:
                        return
                    nxt = off + 1
                    if msg.key() == key:
                        try:
                            ev = decode(msg.value() or b"")
                        except SchemaError as exc:
                            exc.add_note(f"record at {self.topic}[{part}]@{off}")
                            raise
                        yield LogRecord(ev, part, off)
                    if nxt >= stop:
                        return
        finally:
            self._consumer.unassign()


def start_index(
    client: redis.Redis,
    key_prefix: str,
    tenant: str,
    run_id: str,
    *,
    partition: int | None = None,
) -> int | None:
    """Offset of the run's RUN_STARTED from its start index, or None if not indexed.

    Written by the writer once RUN_STARTED is acknowledged (``producers.run``); an
    optimisation only: without it readers use the run id's time or a scan. With
    ``partition``, an index naming another partition raises ``ConfigError``: the topic's
    partition count changed, so key hashing no longer finds the run's records.
    """
    try:
        raw = client.get(start_key(key_prefix, tenant, run_id))
    except redis.RedisError as exc:
        raise RedisUnavailable(f"start index of {run_id}: {exc}") from exc
    if raw is None:
        return None
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    indexed_partition, offset = (int(x) for x in text.split(":"))
    if partition is not None and indexed_partition != partition:
        raise ConfigError(
            f"run {run_id} started in partition {indexed_partition} but hashes to {partition} "
            "now: the events topic's partition count changed (see `runlog topics check`)"
        )
    return offset
