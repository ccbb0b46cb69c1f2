"""One follower of the events topic per writer process: who wrote what, by key, lately.

A writer confirms a non-safe call's STARTED before running the tool: no record of the run
that another writer wrote may stand between the writer's confirmed view and the STARTED
(a newer owner's claim would fence it). When other runs share the partition and wrote in
between, the writer cannot tell from its own offsets alone, and reading the run back costs
a consumer assignment and a fetch per call. ``LogTail`` reads each partition a process
writes to once, in one background consumer, and keeps the (offset, key) of every record
in a window; a confirmation then asks it which offsets of one key lie in a range.

It answers None when it cannot answer for sure (the range starts before what it holds, it
is not there yet, or it failed); the caller then reads the log itself.

A partition followed whole (``follow_whole``: from its beginning) also answers "this key
has no record below offset N", N being what it has read (``unseen_below``), without a read:
a worker opening a requested run that nobody has started yet learns it is new from what the
tail has read, where a read would scan the partition from its beginning (only such a scan
may conclude a run has no history, and the tail's is one), and its claim reads the run back
from N.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from dataclasses import dataclass, field

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, TopicPartition

from runlog._settings import Settings
from runlog.log._kafka import reader_config

log = logging.getLogger(__name__)

WINDOW = 200_000
"""Records kept per partition; a range older than this is answered by a read."""
LIVE_WAIT_S = 0.5
"""How long ``unseen_below`` waits for the tail to reach the high watermark its fetch saw
(a live tail is there in milliseconds) before the caller reads instead."""


@dataclass
class _Partition:
    start: int
    """The first offset this tail followed; nothing before it is known."""
    next: int
    """The offset after the last record read."""
    offsets: list[int] = field(default_factory=list)
    keys: list[bytes | None] = field(default_factory=list)
    seen: set[bytes | None] | None = None
    """Every key read, when the partition is followed from its beginning (else None)."""
    high: int = -1
    """The partition's high watermark as the tail's last fetch reported it (-1: none yet)."""

    def trim(self) -> None:
        if len(self.offsets) > 2 * WINDOW:
            cut = len(self.offsets) - WINDOW
            self.start = self.offsets[cut]
            del self.offsets[:cut], self.keys[:cut]
            self.seen = None  # no longer the whole partition


class LogTail:
    """Thread-safe. ``offsets_of(partition, key, since, upto)`` after ``follow``."""

    def __init__(self, settings: Settings, *, wait_s: float = 5.0) -> None:
        self._topic = settings.events_topic
        self._wait_s = wait_s
        self._conf = reader_config(settings, **{"enable.partition.eof": False})
        self._cond = threading.Condition()
        self._parts: dict[int, _Partition] = {}
        self._to_assign: list[TopicPartition] = []
        self._failed: str | None = None
        self._closed = False
        self._thread: threading.Thread | None = None

    def follow(self, partition: int, offset: int) -> None:
        """Follow ``partition`` from ``offset`` on (no-op if already followed)."""
        with self._cond:
            if partition in self._parts or self._closed:
                return
            self._parts[partition] = _Partition(start=offset, next=offset)
            self._to_assign.append(TopicPartition(self._topic, partition, offset))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="runlog-tail", daemon=True)
                self._thread.start()

    def follow_whole(self, partition: int) -> None:
        """Follow ``partition`` from its beginning (no-op if already followed), so that
        ``unseen_below`` can answer for it until it outgrows the window."""
        with self._cond:
            if partition in self._parts or self._closed:
                return
            self._parts[partition] = _Partition(start=0, next=0, seen=set())
            self._to_assign.append(TopicPartition(self._topic, partition, OFFSET_BEGINNING))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="runlog-tail", daemon=True)
                self._thread.start()

    def unseen_below(self, partition: int, key: bytes) -> int | None:
        """The offset below which ``partition`` holds no record keyed ``key``, as read from
        its beginning: what the tail has read, once it has read up to the high watermark its
        own last fetch reported (waiting up to ``LIVE_WAIT_S`` for that; no broker request).
        None when it cannot say (not followed whole, outgrown its window, not caught up,
        failed, closed, past that watermark: a topic made again) or the key has a record
        below that offset.

        The key may have records from that offset on (written since the fetch, or in
        flight): a caller that concludes from this that a run is new must read the run back
        from that offset before acting on it, as a claim does (``runlog.producers._opening``).

        Not covered: a topic deleted and made again under the process that grows past what
        the tail had read of the old one before the tail's fetch notices (the offsets then
        never go back). Recreating the events topic under live writers loses every run's
        history anyway."""
        deadline = time.monotonic() + min(self._wait_s, LIVE_WAIT_S)
        with self._cond:
            part = self._parts.get(partition)
            if part is None or part.seen is None:
                return None

            def left() -> float:
                return max(0.0, deadline - time.monotonic())

            # The watermark its fetches have seen when asked (one seen at all, first): it
            # has fetched up to there, and only has to have read it. Not a moving target:
            # other writers' records keep raising the next fetch's.
            self._cond.wait_for(lambda: self._stopped() or part.high >= 0, timeout=left())
            target = part.high
            self._cond.wait_for(lambda: self._stopped() or part.next >= target, timeout=left())
            if self._stopped() or part.seen is None or target < 0 or part.next < target:
                return None
            if part.next > part.high or key in part.seen:
                # Past what its fetch saw: the log went back under it (a topic made again).
                return None
            return part.next

    def offsets_of(
        self, partition: int, key: bytes, since: int, upto: int, *, wait_s: float | None = None
    ) -> list[int] | None:
        """Offsets in ``[since, upto]`` of records keyed ``key``, once the tail has read
        past ``upto`` (waiting ``wait_s``, default the tail's own); None when it cannot say
        for sure."""
        with self._cond:
            part = self._parts.get(partition)
            if part is None or since < part.start:
                return None
            ok = self._cond.wait_for(
                lambda: self._failed is not None or self._closed or part.next > upto,
                timeout=self._wait_s if wait_s is None else wait_s,
            )
            if not ok or self._failed is not None or self._closed or since < part.start:
                return None
            lo = bisect.bisect_left(part.offsets, since)
            hi = bisect.bisect_right(part.offsets, upto)
            return [part.offsets[i] for i in range(lo, hi) if part.keys[i] == key]

    def _run(self) -> None:
        consumer: Consumer | None = None
        try:
            consumer = Consumer(self._conf)
            while True:
                with self._cond:
                    if self._closed:
                        return
                    todo, self._to_assign = self._to_assign, []
                if todo:
                    consumer.incremental_assign(todo)
                    self._first_highs(consumer, todo)
                got = []
                # poll() returns at the first record (consume() would wait for a full
                # batch or its timeout, and a confirmation waits on this loop); what is
                # already fetched behind it comes without waiting.
                first = consumer.poll(0.05)
                batch = [] if first is None else [first, *consumer.consume(1000, timeout=0)]
                for msg in batch:
                    err = msg.error()
                    if err is not None:
                        if err.code() != KafkaError._PARTITION_EOF:
                            log.warning("log tail: %s", err)
                        continue
                    got.append((msg.partition(), msg.offset(), msg.key()))
                highs = self._highs(consumer)
                with self._cond:
                    for partition, offset, key in got:
                        self._record(partition, offset, key)
                    for partition, high in highs.items():
                        self._parts[partition].high = high
                    self._cond.notify_all()
        except (KafkaException, RuntimeError) as exc:
            log.warning("log tail stopped: %s", exc)
            with self._cond:
                self._failed = str(exc)
                self._cond.notify_all()
        finally:
            if consumer is not None:
                consumer.close()

    def _stopped(self) -> bool:
        """Under ``_cond``."""
        return self._failed is not None or self._closed

    def _first_highs(self, consumer: Consumer, assigned: list[TopicPartition]) -> None:
        """Ask the broker once for the high watermark of each partition just followed
        whole: a fetch that returns no record need not report one (a partition nobody has
        written to stays unknown until its first record), and ``unseen_below`` answers
        only once one is known."""
        for tp in assigned:
            with self._cond:
                part = self._parts.get(tp.partition)
                if part is None or part.seen is None:
                    continue
            try:
                _, high = consumer.get_watermark_offsets(
                    TopicPartition(self._topic, tp.partition), timeout=5, cached=False
                )
            except KafkaException as exc:  # its fetches report one soon enough
                log.warning("log tail: watermark of partition %s: %s", tp.partition, exc)
                continue
            with self._cond:
                if int(high) >= 0:
                    part.high = max(part.high, int(high))
                self._cond.notify_all()

    def _highs(self, consumer: Consumer) -> dict[int, int]:
        """The high watermarks the consumer's last fetches reported, of the partitions
        followed whole (a local look-up: no request)."""
        with self._cond:
            whole = [p for p, part in self._parts.items() if part.seen is not None]
        out = {}
        for p in whole:
            _, high = consumer.get_watermark_offsets(TopicPartition(self._topic, p), cached=True)
            if high >= 0:
                out[p] = int(high)
        return out

    def _record(self, partition: int | None, offset: int | None, key: bytes | None) -> None:
        """Under ``_cond``."""
        if partition is None or offset is None:
            return
        part = self._parts.get(partition)
        if part is None:
            return
        if offset < part.next:
            # The log went back (its topic deleted and made again under this process):
            # nothing the tail read of it holds any more, so it answers nothing for it.
            part.start, part.seen = 1 << 62, None
            log.warning("log tail: partition %s went back to offset %s", partition, offset)
            return
        part.offsets.append(offset)
        part.keys.append(key)
        if part.seen is not None:
            part.seen.add(key)
        part.next = offset + 1
        part.trim()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)
