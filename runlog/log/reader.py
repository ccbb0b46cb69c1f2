"""Read one run's events from the log, starting where the run starts.

Kafka cannot filter by key on the broker, so a reader starts as close to the run's first
event as it is told (``runlog.log.fold.locate``: the run's start index, or the run id's
embedded creation time with ``offsets_for_times``, both checked against what they find),
or at the partition's beginning, and reads to the high watermark, decoding only the
records whose key is the run id.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, cast

import redis
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from runlog.errors import ConfigError, KafkaUnavailable, SchemaError, UnreadableRecord
from runlog.log.authority import tenant_keys_for
from runlog.log.clients import redis_client
from runlog.log.kafka import (
    RETRY_FOR_S,
    high_watermark,
    partitions_of,
    reader_config,
    retrying,
)
from runlog.log.keys import keys_for, learn
from runlog.log.registry import ids_for
from runlog.log.setaside import set_aside_offsets
from runlog.schemas.codec import decode
from runlog.schemas.keys import partition_for, run_id_time_ms
from runlog.schemas.models import Event
from runlog.settings import Settings

# How far before a run id's creation time to start looking: covers producer clock skew.
START_SKEW_MS = 60_000


@dataclass(frozen=True)
class Position:
    partition: int
    offset: int


@dataclass(frozen=True)
class LogRecord:
    event: Event
    partition: int
    offset: int
    forged: str | None = None
    """Why its tenant's MAC does not authenticate it (``schemas.tenant_mac``), else None:
    the fold rejects a forged record (``accept(..., forged)``)."""


class LogReader:
    """Reads runs' events. Not thread-safe; cheap to create per replay."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.topic = settings.events_topic
        self._made: Consumer | None = None
        self._partitions: int | None = None
        self._ids = ids_for(settings)
        self._keys = keys_for(settings)
        self._redis: redis.Redis | None = None
        self._tenants = tenant_keys_for(settings)

    @property
    def _consumer(self) -> Consumer:
        """The reader's Kafka consumer, made at its first use: a reader borrowed for an open
        that the process's log tail answers (a requested run nobody started) never makes
        one (its threads, its connections, its metadata request)."""
        if self._made is None:
            self._made = Consumer(reader_config(self.settings))
        return self._made

    def close(self) -> None:
        if self._made is not None:
            self._made.close()
        if self._redis is not None:
            self._redis.close()

    def __enter__(self) -> LogReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _set_aside(self, partition: int) -> frozenset[int]:
        if self._redis is None:
            self._redis = redis_client(self.settings)
        return set_aside_offsets(self._redis, self.settings, partition)

    def _unreadable(self, run_id: str, part: int, off: int, exc: SchemaError) -> UnreadableRecord:
        where = f"{self.topic}[{part}]@{off}"
        return UnreadableRecord(
            f"record {where} of run {run_id} cannot be decoded ({type(exc).__name__}: {exc}); "
            "runlog will not act on a log it cannot read. If a newer runlog wrote it, run "
            "that version; if it carries nothing the run needs, set it aside: `runlog records "
            f"set-aside --partition {part} --offset {off} --by NAME --reason WHY`",
            topic=self.topic,
            partition=part,
            offset=off,
        )

    def partition_count(self) -> int:
        """The events topic's partition count, refused if it is not the deployment's.

        A run lives in the partition its id hashes to under the count it was started with.
        Once partitions are added the same id hashes elsewhere: a reader would find nothing
        there and a writer would start the run again from seq 1. So every reader compares
        the topic with ``RUNLOG_PARTITIONS`` before locating anything.
        """
        if self._partitions is None:
            count = len(partitions_of(self._consumer, self.topic))
            if count != self.settings.partitions:
                raise ConfigError(
                    f"topic {self.topic} has {count} partitions but RUNLOG_PARTITIONS is "
                    f"{self.settings.partitions}: runs are located by hashing their id over "
                    "the count they were started with, so runlog refuses to read or write "
                    "until they agree (docs/howto/production.md: growing a fleet)"
                )
            self._partitions = count
        return self._partitions

    def partition_of(self, run_id: str) -> int:
        return partition_for(run_id, self.partition_count())

    def high_watermark(self, partition: int) -> int:
        return high_watermark(self._consumer, self.topic, partition)

    def low_watermark(self, partition: int) -> int:
        """The partition's first offset still in the log, from the broker."""
        tp = TopicPartition(self.topic, partition)
        low, _ = retrying(
            f"watermarks of {self.topic}[{partition}]",
            lambda: self._consumer.get_watermark_offsets(tp, timeout=10, cached=False),
        )
        return int(low)

    def record_at(self, partition: int, offset: int) -> tuple[bytes | None, bytes | None]:
        """``(key, value)`` of the record at ``offset``; KafkaUnavailable if there is none."""
        if not 0 <= offset < self.high_watermark(partition):
            raise KafkaUnavailable(f"{self.topic}[{partition}] has no record at {offset}")
        self._consumer.assign([TopicPartition(self.topic, partition, offset)])
        try:
            for _ in range(20):
                for msg in self._consumer.consume(1, timeout=0.5):
                    if msg.error() is None and msg.offset() == offset:
                        return msg.key(), msg.value()
            raise KafkaUnavailable(f"could not fetch {self.topic}[{partition}]@{offset}")
        finally:
            self._consumer.unassign()

    def start_offset(self, run_id: str, partition: int, hint: int | None = None) -> int:
        """Best known offset at or before the run's first event.

        A run id's embedded time is only a hint: a caller may choose an id shaped like a
        minted one (``r`` + 28 hex digits) whose "time" is anything, and a minting clock
        may run ahead. A time this clock has not reached yet, or a look-up that finds no
        record at or after it, says nothing about the run's history, so both start at the
        partition's beginning, never at its high watermark (which would read no history
        and let a writer start the run again).
        """
        if hint is not None:
            return hint
        created = run_id_time_ms(run_id)
        if created is None or created > time.time() * 1000 + START_SKEW_MS:
            return OFFSET_BEGINNING
        tp = TopicPartition(self.topic, partition, max(0, created - START_SKEW_MS))
        (found,) = retrying(
            "offsets_for_times", lambda: self._consumer.offsets_for_times([tp], timeout=10)
        )
        if found.offset >= 0:
            return int(found.offset)
        return OFFSET_BEGINNING

    def read(
        self,
        run_id: str,
        *,
        partition: int | None = None,
        start: int | None = None,
        end: int | None = None,
    ) -> Generator[LogRecord, None, None]:
        """Events of ``run_id`` in log order, from ``start`` (default: the partition's
        beginning) up to (excluding) ``end``.

        ``end`` defaults to the high watermark when the read begins. A record of this run
        that does not decode raises ``UnreadableRecord`` naming it and the remedy (a writer
        must never resume past a fact it cannot read), unless an operator set it aside.
        """
        part = self.partition_of(run_id) if partition is None else partition
        stop = self.high_watermark(part) if end is None else end
        # No start: the partition's beginning. Seeking by an index or the id's time is
        # ``runlog.log.fold``'s job, which checks what such a start finds.
        offset = OFFSET_BEGINNING if start is None else start
        if stop == 0 or (offset != OFFSET_BEGINNING and offset >= stop):
            return
        key = run_id.encode()
        if offset < 0:
            # The beginning as an offset: ``want`` below can then stop at ``stop`` (asking
            # for 500 records waits out consume()'s whole timeout when fewer are left).
            offset = self.low_watermark(part)
            if offset >= stop:
                return
        self._consumer.assign([TopicPartition(self.topic, part, offset)])
        nxt = offset
        quiet_since = time.monotonic()
        try:
            while True:
                # consume() waits its whole timeout unless the batch fills, even at the end
                # of the partition: ask for no more than the records left before ``stop``,
                # so a short replay (every open_run's read-back) returns at once.
                want = max(1, min(500, stop - nxt))
                batch = self._consumer.consume(want, timeout=1.0)
                if batch:
                    quiet_since = time.monotonic()
                elif time.monotonic() - quiet_since > RETRY_FOR_S:
                    # Records below ``stop`` exist, yet nothing arrives (the partition was
                    # deleted or its leader is gone for good): say so instead of waiting
                    # forever.
                    raise KafkaUnavailable(
                        f"reading {self.topic}[{part}]: no record for {RETRY_FOR_S:.0f} s "
                        f"although the log reaches offset {stop}"
                    )
                for msg in batch:
                    err = msg.error()
                    if err is not None and err.code() != err._PARTITION_EOF:
                        # Before the offset: a refusal (an ACL) carries none, and its
                        # reason is what the caller needs.
                        raise KafkaUnavailable(f"reading {self.topic}[{part}]: {err}")
                    off = msg.offset()
                    assert off is not None  # consumed messages and EOF events carry one
                    if err is not None:
                        if off >= stop:
                            return
                        continue
                    if off >= stop:
                        return
                    nxt = off + 1
                    if msg.key() == key:
                        try:
                            ev = decode(msg.value() or b"", self._ids, self._keys)
                        except SchemaError as exc:
                            if off in self._set_aside(part):
                                continue  # a person decided it does not count: skip it
                            raise self._unreadable(run_id, part, off, exc) from exc
                        learn(self._keys, ev)
                        forged = self._tenants.check(
                            ev.tenant, key, msg.value() or b"", _headers(msg)
                        )
                        yield LogRecord(ev, part, off, forged)
                    if nxt >= stop:
                        return
        finally:
            self._consumer.unassign()


def _headers(msg: Any) -> list[tuple[str, str | bytes | None]]:
    """A consumed message's headers as confluent_kafka returns them (a list of pairs)."""
    return cast(list[tuple[str, str | bytes | None]], msg.headers() or [])


class ReaderPool:
    """Readers kept open between uses: a run's open (and its confirmations) borrow one.

    A new reader is a new Kafka consumer: a connection to the bootstrap broker, a metadata
    request for the partition count, then a connection to the partition's leader. That is
    tens of milliseconds of every ``open_run`` (on an idle fleet, most of the time from
    ``runlog.start`` to the run's first event). A reader is not thread-safe, so each user
    gets one to itself; ``close()`` gives it back (up to ``keep`` idle readers are kept, the
    rest are closed). Every read assigns its own partition and offset, and the partition
    count is checked again, so nothing of one use carries into the next.
    """

    def __init__(self, settings: Settings, *, keep: int = 16) -> None:
        self.settings = settings
        self.keep = keep
        self._idle: list[_PooledReader] = []
        self._lock = threading.Lock()
        self._closed = False

    def get(self) -> LogReader:
        with self._lock:
            reader = self._idle.pop() if self._idle else None
        if reader is None:
            return _PooledReader(self)
        # The partition count is asked of the broker again on each use (over the open
        # connection: a millisecond), so a topic recreated meanwhile is still refused.
        reader._partitions = None
        return reader

    def _give_back(self, reader: _PooledReader) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self.keep:
                self._idle.append(reader)
                return
        reader.discard()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for reader in idle:
            reader.discard()


class _PooledReader(LogReader):
    def __init__(self, pool: ReaderPool) -> None:
        super().__init__(pool.settings)
        self._pool = pool

    def close(self) -> None:
        self._pool._give_back(self)

    def discard(self) -> None:
        LogReader.close(self)
