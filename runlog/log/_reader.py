"""Read one run's events from the log, starting where the run starts.

Kafka cannot filter by key on the broker, so a reader starts as close to the run's first
event as it is told (``runlog.log._fold.locate``: the run's start index, or the run id's
embedded creation time with ``offsets_for_times``, both checked against what they find),
or at the partition's beginning, and reads to the high watermark, decoding only the
records whose key is the run id.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, cast

import redis
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from runlog._settings import Settings
from runlog.errors import ConfigError, KafkaUnavailable, SchemaError, UnreadableRecord
from runlog.log._authority import tenant_keys_for
from runlog.log._clients import redis_client
from runlog.log._kafka import (
    RETRY_FOR_S,
    high_watermark,
    partitions_of,
    reader_config,
    retrying,
)
from runlog.log._keys import keys_for, learn
from runlog.log._registry import ids_for
from runlog.log._setaside import set_aside_offsets
from runlog.schemas._codec import decode
from runlog.schemas._keys import partition_for, run_id_time_ms, start_key
from runlog.schemas._models import Event

log = logging.getLogger(__name__)

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
    """Why its tenant's MAC does not authenticate it (``schemas._tenant_mac``), else None:
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
        if self.prefetch is not None and self.prefetch.partitions is not None:
            return self.prefetch.partitions  # checked by the pass's reader moments ago
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

    prefetch: Prefetch | None = None
    """Records of many runs read at once (``Prefetch``): a read of one of those runs that
    lies inside what it read is answered from it, without asking the broker."""

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
        if self.prefetch is not None and start is not None and end is not None:
            held = self.prefetch.records(run_id, part, start, end)
            if held is not None:
                yield from held
                return
        for _, rec in self.read_keys({run_id}, partition=part, start=start, end=end):
            yield rec

    def read_keys(
        self,
        run_ids: set[str],
        *,
        partition: int,
        start: int | None = None,
        end: int | None = None,
    ) -> Generator[tuple[str, LogRecord], None, None]:
        """``(run id, event)`` of any of ``run_ids`` (all in ``partition``) in log order,
        the run id being the record's key: ``read`` of many runs in one pass."""
        part = partition
        stop = self.high_watermark(part) if end is None else end
        # No start: the partition's beginning. Seeking by an index or the id's time is
        # ``runlog.log._fold``'s job, which checks what such a start finds.
        offset = OFFSET_BEGINNING if start is None else start
        if stop == 0 or (offset != OFFSET_BEGINNING and offset >= stop):
            return
        keys = {r.encode() for r in run_ids}
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
                    key = msg.key()
                    if key is not None and key in keys:
                        try:
                            ev = decode(msg.value() or b"", self._ids, self._keys)
                        except SchemaError as exc:
                            if off in self._set_aside(part):
                                continue  # a person decided it does not count: skip it
                            raise self._unreadable(key.decode(), part, off, exc) from exc
                        learn(self._keys, ev)
                        forged = self._tenants.check(
                            ev.tenant, key, msg.value() or b"", _headers(msg)
                        )
                        yield key.decode(), LogRecord(ev, part, off, forged)
                    if nxt >= stop:
                        return
        finally:
            self._consumer.unassign()


def _headers(msg: Any) -> list[tuple[str, str | bytes | None]]:
    """A consumed message's headers as confluent_kafka returns them (a list of pairs)."""
    return cast(list[tuple[str, str | bytes | None]], msg.headers() or [])


COUNT_RECHECK_S = 1.0
"""How long a partition count one pooled reader had from the broker serves the pool's
other readers (``ReaderPool.get``)."""


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
        self._count: int | None = None
        self._count_at = -COUNT_RECHECK_S
        self._closed = False

    def get(self) -> LogReader:
        with self._lock:
            reader = self._idle.pop() if self._idle else None
        if reader is None:
            return _PooledReader(self)
        # The partition count is asked of the broker again (over the open connection), so
        # a topic recreated meanwhile is still refused; at most once every
        # ``COUNT_RECHECK_S`` for the whole pool: a burst of opens (a worker taking over a
        # drained or dead worker's runs) would otherwise wait for one metadata request
        # each, on a loaded broker as long as the replay's own fetch.
        with self._lock:
            fresh = time.monotonic() - self._count_at < COUNT_RECHECK_S
            reader._partitions = self._count if fresh else None
        return reader

    def _counted(self, count: int) -> None:
        with self._lock:
            self._count, self._count_at = count, time.monotonic()

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

    def partition_count(self) -> int:
        known = self._partitions
        count = super().partition_count()
        if known is None and self.prefetch is None:
            self._pool._counted(count)  # asked of the broker just now
        return count

    def close(self) -> None:
        self._pool._give_back(self)

    def discard(self) -> None:
        LogReader.close(self)


class Prefetch:
    """The records of many runs of one partition, read in one pass (``read_keys``).

    A worker that adopts a dead worker's runs opens hundreds of them at once, and each
    open's replay would read the partition from that run's start to its high watermark:
    the same records once per run, most of them other runs'. One pass from the earliest
    start serves every one of them instead (``LogReader.read`` answers from it a read
    that lies inside it). A replay that stops at ``end`` is the run as the log held it
    then; the claim reads the run back from ``end`` on, as it always reads from where
    the replay stopped, so records written after the pass (a paused ex-owner's) are
    still seen before anything is acted on.

    Thread-safe: the first open that needs it reads it (``load``), the others wait for
    that read. A read that fails leaves every open to read for itself.
    """

    def __init__(
        self, partition: int, runs: dict[str, str], reads: threading.Semaphore | None = None
    ) -> None:
        """``reads``: a bound on the passes read at once (each is a reader's consumer)."""
        self.partition = partition
        self._reads = reads
        self.runs = dict(runs)
        """run id -> tenant (what its start index is keyed by)."""
        self.start = -1
        self.end = -1
        self.partitions: int | None = None
        """The topic's partition count, as the pass's reader checked it."""
        self._starts: dict[str, int] = {}
        self._records: dict[str, list[LogRecord]] = {}
        self._lock = threading.Lock()
        self._state = "new"
        self._asked = 0.0
        """When ``end`` was asked of the broker (monotonic): what was acknowledged before
        that lies below it."""

    def load(self, settings: Settings, client: redis.Redis, factory: Any) -> bool:
        """Read the partition once (``factory()``: a reader), from the earliest of the
        runs' start indexes (one ``MGET``) to its high watermark; whether it holds them."""
        with self._lock:
            if self._state == "new":
                self._state = "failed"
                try:
                    if self._reads is None:
                        self._read(settings, client, factory)
                    else:
                        with self._reads:
                            self._read(settings, client, factory)
                    self._state = "loaded"
                    log.info(
                        "partition %s read once for %d runs (offsets %s to %s)",
                        self.partition,
                        len(self.runs),
                        self.start,
                        self.end,
                    )
                except Exception as exc:  # noqa: BLE001 - every open reads for itself instead
                    self._records.clear()
                    log.warning(
                        "partition %s not read for %d runs at once (%s): each reads its own",
                        self.partition,
                        len(self.runs),
                        exc,
                    )
            return self._state == "loaded"

    def _read(self, settings: Settings, client: redis.Redis, factory: Any) -> None:
        ids = sorted(self.runs)
        raw = client.mget([start_key(settings.redis_key_prefix, self.runs[r], r) for r in ids])
        starts: dict[str, int] = {}
        for rid, value in zip(ids, raw, strict=True):
            if value is None:
                continue  # not indexed: that run's own read locates it
            text = value.decode() if isinstance(value, bytes) else str(value)
            part, offset = (int(x) for x in text.split(":")[:2])
            if part == self.partition:
                starts[rid] = offset  # another partition: the run's own look-up refuses it
        if not starts:
            raise LookupError("no start index")
        reader = factory()
        try:
            self.partitions = reader.partition_count()
            self._asked = time.monotonic()
            self.end = reader.high_watermark(self.partition)
            self.start = min(starts.values())
            self._starts = starts
            got: dict[str, list[LogRecord]] = {r: [] for r in ids}
            for rid, rec in reader.read_keys(
                set(ids), partition=self.partition, start=self.start, end=self.end
            ):
                got[rid].append(rec)
            self._records = got
        finally:
            reader.close()

    @property
    def failed(self) -> bool:
        """Its read failed: each of its runs reads for itself."""
        return self._state == "failed"

    def top_up(self, since: float, factory: Any) -> None:
        """Read on from ``end`` to the high watermark now, unless ``end`` was asked after
        ``since`` (monotonic): a pass read before the runs' leases were taken (a drain's
        runs, read while their last steps ran: ``Worker._warm_coming``) then holds what
        their previous owner wrote up to its release, and a claim made from it does not
        lose its race to those records. Best effort: a pass left short is still right,
        as every claim reads the run back from where its replay stopped."""
        with self._lock:
            if self._state != "loaded" or self._asked >= since:
                return
            try:
                reader = factory()
            except Exception as exc:  # noqa: BLE001 - see above
                log.warning("partition %s pass not read on: %s", self.partition, exc)
                return
            try:
                asked = time.monotonic()
                end = reader.high_watermark(self.partition)
                more: dict[str, list[LogRecord]] = {}
                if end > self.end:
                    for rid, rec in reader.read_keys(
                        set(self._records), partition=self.partition, start=self.end, end=end
                    ):
                        more.setdefault(rid, []).append(rec)
                # Each run's list replaced whole, then ``end`` moved: a replay reading the
                # pass meanwhile sees the old records up to the old end, or all of them.
                for rid, recs in more.items():
                    self._records[rid] = [*self._records.get(rid, []), *recs]
                self.end = max(self.end, end)
                self._asked = asked
            except Exception as exc:  # noqa: BLE001 - see above
                log.warning("partition %s pass not read on: %s", self.partition, exc)
            finally:
                reader.close()

    def start_of(self, tenant: str, run_id: str) -> int | None:
        """The run's start index (of ``tenant``'s) as the pass read it, or None."""
        if self._state != "loaded" or self.runs.get(run_id) != tenant:
            return None
        return self._starts.get(run_id)

    def records(self, run_id: str, partition: int, start: int, end: int) -> list[LogRecord] | None:
        """The run's records in ``[start, end)`` if this pass covers that range, else None."""
        if self._state != "loaded" or partition != self.partition:
            return None
        held = self._records.get(run_id)
        if held is None or start < self.start or end > self.end:
            return None
        return [rec for rec in held if start <= rec.offset < end]
