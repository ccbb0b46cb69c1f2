"""The projection runner: Kafka in, pure folds, one atomic Redis write per partition batch.

Exactly-once effects on an at-least-once log: Redis, not Kafka, holds each projection's
position per (topic, partition). A partition batch is applied as

1. ``WATCH pos``; read it; drop the records at or below it;
2. load the batch's runs (one MGET), fold the records with the pure projection;
3. ``MULTI`` -> the new run states, entries, counters, quarantine records and ``SET pos``
   -> ``EXEC``.

Effect and position commit together or not at all, so a SIGKILL at any moment loses
nothing and applies nothing twice. ``WATCH`` makes a zombie (a runner that lost the
partition in a rebalance but is still finishing a batch) harmless: if anyone moved the
position meanwhile, EXEC fails and the batch is recomputed from the new position.

On assignment every partition is seeked to ``min(position over the projections) + 1``.
Kafka offset commits are advisory (for ``kafka-consumer-groups`` lag) and never read.

A record that cannot be decoded, or whose key is not its event's run id, is quarantined:
produced (original key, value and headers) to the quarantine topic and acknowledged
*before* the Redis write that records it and advances the position. A crash between the
two re-quarantines it on restart: the topic is at-least-once, Redis exactly-once.
Transient Redis and broker errors are retried with capped exponential backoff; they
never turn into skipped records.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import logging
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, Producer, TopicPartition

from runlog.consumers.store import Decoded, Handler, Rejected, dumps, make_handler
from runlog.errors import KafkaUnavailable, RedisUnavailable, RunlogError, SchemaError
from runlog.log.kafka import group_config, high_watermark, partitions_of
from runlog.schemas.codec import decode
from runlog.settings import Settings

log = logging.getLogger(__name__)

T = TypeVar("T")

BATCH_SIZE = 500
CATCH_UP_BATCH = 5000
POLL_TIMEOUT_S = 0.05
BACKOFF_START_S = 0.05
BACKOFF_CAP_S = 5.0

_TRANSIENT_REDIS = (redis.ConnectionError, redis.TimeoutError)


class KeyMismatch(SchemaError):
    """A record's Kafka key is not the run id inside its event: it violates the layout."""


class Stopped(RunlogError):
    """The runner was asked to stop while waiting to retry."""


def default_group(settings: Settings, projections: Sequence[str]) -> str:
    return f"{settings.topic_prefix}.projection.{'+'.join(projections)}"


@dataclass
class RunnerStats:
    """In-process counters (the durable ones are in Redis, see ``consumers.store``)."""

    applied: Counter[str] = field(default_factory=Counter)
    """Records folded, per projection."""
    quarantined: int = 0
    skipped: int = 0
    """Records at or below a stored position (redelivered after a restart or rebalance)."""
    watch_conflicts: int = 0
    retries: int = 0
    batches: int = 0
    lag: dict[int, int] = field(default_factory=dict)
    """Partition -> high watermark minus next offset, as of the last batch."""


def _record_of(msg: Any) -> Decoded | Rejected:
    partition, offset = msg.partition(), msg.offset()
    key = msg.key()
    run_key = None if key is None else key.decode("utf-8", "replace")
    try:
        ev = decode(msg.value())
        if run_key != ev.run_id:
            raise KeyMismatch(f"record key {run_key!r} is not its event's run id {ev.run_id!r}")
    except SchemaError as exc:
        return Rejected(run_key, partition, offset, type(exc).__name__, str(exc))
    return Decoded(ev, partition, offset)


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode()


class ProjectionRunner:
    """Runs one or more projections off one consumer (fan-out, one position each).

    Not thread-safe; ``stop()`` may be called from any thread or a signal handler.
    """

    def __init__(
        self,
        settings: Settings,
        client: redis.Redis,
        projections: Sequence[str],
        *,
        group: str | None = None,
        batch_size: int = BATCH_SIZE,
        consumer_extra: dict[str, Any] | None = None,
    ) -> None:
        if not projections:
            raise ValueError("at least one projection")
        self.settings = settings
        self.topic = settings.events_topic
        self.redis = client
        self.handlers: list[Handler[Any]] = [
            make_handler(n, settings.redis_key_prefix, self.topic) for n in projections
        ]
        self.group = group or default_group(settings, projections)
        self.batch_size = batch_size
        self.stats = RunnerStats()
        self._stop = threading.Event()
        self._consumer_extra = dict(consumer_extra or {})
        self._consumer: Any = None
        self._producer: Any = None
        self._assigned: set[int] = set()
        self._next: dict[int, int] = {}

    # Control ----------------------------------------------------------------------------
    def stop(self) -> None:
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def _retry(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()`` until it succeeds; transient errors back off, capped. Others propagate."""
        delay = BACKOFF_START_S
        while True:
            try:
                return fn()
            except _TRANSIENT_REDIS as exc:
                err: Exception = exc
            except KafkaUnavailable as exc:
                err = exc
            self.stats.retries += 1
            log.warning("%s failed (%s); retrying in %.2fs", what, err, delay)
            if self._stop.wait(delay):
                raise Stopped(f"stopped while retrying {what}") from err
            delay = min(delay * 2, BACKOFF_CAP_S)

    # Positions --------------------------------------------------------------------------
    def positions(self, partitions: Iterable[int]) -> dict[int, int]:
        """Lowest stored position over this runner's projections, per partition (-1: none)."""
        parts = sorted(partitions)
        if not parts:
            return {}
        keys = [h.keys.pos(p) for p in parts for h in self.handlers]

        def read() -> list[Any]:
            return list(self.redis.mget(keys))

        raws = self._retry("reading positions", read)
        n = len(self.handlers)
        out: dict[int, int] = {}
        for i, p in enumerate(parts):
            vals = [int(r) if r is not None else -1 for r in raws[i * n : (i + 1) * n]]
            out[p] = min(vals)
        return out

    def _on_assign(self, consumer: Any, partitions: list[Any]) -> None:
        pos = self.positions(tp.partition for tp in partitions)
        for tp in partitions:
            p = pos[tp.partition]
            tp.offset = p + 1 if p >= 0 else OFFSET_BEGINNING
            self._next[tp.partition] = max(p + 1, 0)
        consumer.assign(partitions)
        self._assigned |= {tp.partition for tp in partitions}
        log.info("assigned %s", {tp.partition: tp.offset for tp in partitions})

    def _on_revoke(self, consumer: Any, partitions: list[Any]) -> None:
        # Batches are applied between polls, so none is in flight here; a batch whose
        # partition was revoked during the poll that returned it is dropped (below) and
        # the new owner applies it from the stored position.
        self._assigned -= {tp.partition for tp in partitions}
        for tp in partitions:
            self.stats.lag.pop(tp.partition, None)
        log.info("revoked %s", sorted(tp.partition for tp in partitions))

    # Kafka ------------------------------------------------------------------------------
    def _make_consumer(self, **extra: Any) -> Any:
        conf = group_config(self.settings, self.group, **{**self._consumer_extra, **extra})
        return Consumer(conf, logger=log)

    def _quarantine_producer(self) -> Any:
        if self._producer is None:
            conf = dict(self.settings.kafka_common())
            conf.update({"enable.idempotence": True, "acks": "all", "linger.ms": 5})
            self._producer = Producer(conf, logger=log)
        return self._producer

    def _produce_quarantined(self, msgs: list[Any], errors: dict[int, Rejected]) -> None:
        """Copy the records to the quarantine topic and wait for every acknowledgement."""
        producer = self._quarantine_producer()
        failures: list[KafkaError] = []

        def on_delivery(err: KafkaError | None, _msg: Any) -> None:
            if err is not None:
                failures.append(err)

        def send() -> None:
            failures.clear()
            for msg in msgs:
                rej = errors[msg.offset()]
                headers = list(msg.headers() or [])
                headers += [
                    ("runlog.quarantine.topic", self.topic.encode()),
                    ("runlog.quarantine.partition", str(msg.partition()).encode()),
                    ("runlog.quarantine.offset", str(msg.offset()).encode()),
                    ("runlog.quarantine.error", rej.error.encode()),
                    ("runlog.quarantine.group", self.group.encode()),
                ]
                producer.produce(
                    self.settings.quarantine_topic,
                    key=msg.key(),
                    value=msg.value(),
                    headers=headers,
                    on_delivery=on_delivery,
                )
            remaining = producer.flush(30)
            if remaining or failures:
                raise KafkaUnavailable(
                    f"quarantine topic {self.settings.quarantine_topic}: "
                    f"{remaining} unacknowledged, errors {[str(f) for f in failures]}"
                )

        self._retry("producing to the quarantine topic", send)

    # Applying ---------------------------------------------------------------------------
    def _apply_partition(self, partition: int, msgs: list[Any]) -> None:
        recs = [_record_of(m) for m in msgs]
        rejected = {r.offset: r for r in recs if isinstance(r, Rejected)}
        if rejected:
            low = self.positions([partition])[partition]
            todo = [m for m in msgs if m.offset() in rejected and m.offset() > low]
            if todo:
                self._produce_quarantined(todo, rejected)
        raw = {m.offset(): m for m in msgs}
        for handler in self.handlers:
            self._retry(
                f"applying {handler.name} to {self.topic}[{partition}]",
                functools.partial(self._commit, handler, partition, recs, raw),
            )

    def _commit(
        self,
        handler: Handler[Any],
        partition: int,
        recs: list[Decoded | Rejected],
        raw: dict[int, Any],
    ) -> None:
        keys = handler.keys
        pos_key = keys.pos(partition)
        while True:
            with self.redis.pipeline(transaction=True) as pipe:
                try:
                    pipe.watch(pos_key)  # type: ignore[no-untyped-call]
                    stored = pipe.get(pos_key)
                    pos = int(stored) if stored is not None else -1
                    todo = [r for r in recs if r.offset > pos]
                    self.stats.skipped += len(recs) - len(todo)
                    if not todo:
                        return
                    run_ids = sorted(
                        {
                            rid
                            for r in todo
                            if (rid := r.event.run_id if isinstance(r, Decoded) else r.run_id)
                        }
                    )
                    batch = handler.begin(pipe, partition, run_ids)
                    for r in todo:
                        handler.apply(batch, r)
                    applied = sum(1 for r in todo if isinstance(r, Decoded))
                    bad = [r for r in todo if isinstance(r, Rejected)]
                    pipe.multi()
                    handler.write(pipe, batch)
                    for r in bad:
                        msg = raw[r.offset]
                        pipe.hset(
                            keys.quarantine(partition),
                            str(r.offset),
                            dumps(
                                {
                                    "topic": self.topic,
                                    "partition": partition,
                                    "offset": r.offset,
                                    "run_id": r.run_id,
                                    "key_b64": _b64(msg.key()),
                                    "value_b64": _b64(msg.value()),
                                    "headers": [[k, _b64(v)] for k, v in (msg.headers() or [])],
                                    "timestamp_ms": msg.timestamp()[1],
                                    "error": r.error,
                                    "message": r.message,
                                }
                            ),
                        )
                    if applied:
                        pipe.hincrby(keys.stats(partition), "applied", applied)
                    if bad:
                        pipe.hincrby(keys.stats(partition), "quarantined", len(bad))
                    pipe.set(pos_key, todo[-1].offset)
                    pipe.execute()
                except redis.WatchError:
                    # Someone else (a zombie, a rebuild) moved the position: recompute.
                    self.stats.watch_conflicts += 1
                    continue
            self.stats.applied[handler.name] += applied
            self.stats.quarantined += len(bad)
            return

    def _handle(self, msgs: list[Any]) -> None:
        by_part: dict[int, list[Any]] = defaultdict(list)
        for msg in msgs:
            err = msg.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    self._next[msg.partition()] = max(
                        self._next.get(msg.partition(), 0), msg.offset()
                    )
                    continue
                if err.fatal():
                    raise KafkaUnavailable(f"consumer of {self.topic}: {err}")
                log.warning("consumer of %s: %s (librdkafka retries)", self.topic, err)
                continue
            if msg.partition() in self._assigned:
                by_part[msg.partition()].append(msg)
        for partition, part_msgs in sorted(by_part.items()):
            self._apply_partition(partition, part_msgs)
            self._next[partition] = part_msgs[-1].offset() + 1
            self.stats.batches += 1

    def _update_lag(self) -> None:
        for p in self._assigned:
            try:
                _, high = self._consumer.get_watermark_offsets(
                    TopicPartition(self.topic, p), cached=True
                )
            except Exception:  # noqa: BLE001 - lag is a gauge; a failed read keeps the old one
                continue
            if high is not None and high >= 0:
                self.stats.lag[p] = max(0, int(high) - self._next.get(p, 0))

    def _commit_offsets(self) -> None:
        """Advisory only: lets standard Kafka tooling show the group's lag."""
        offsets = [
            TopicPartition(self.topic, p, self._next[p]) for p in self._assigned if p in self._next
        ]
        if offsets:
            try:
                self._consumer.commit(offsets=offsets, asynchronous=True)
            except Exception as exc:  # noqa: BLE001 - advisory; Redis holds the positions
                log.debug("advisory offset commit failed: %s", exc)

    # Main loops -------------------------------------------------------------------------
    def run(self, *, on_batch: Callable[[ProjectionRunner], None] | None = None) -> None:
        """Consume as a group member until ``stop()``."""
        self._consumer = self._make_consumer()
        self._consumer.subscribe(
            [self.topic],
            on_assign=self._on_assign,
            on_revoke=self._on_revoke,
            on_lost=self._on_revoke,
        )
        try:
            while not self._stop.is_set():
                # consume() returns when the batch fills or the timeout ends: under a light
                # load the timeout *is* the projection lag, so keep it short.
                msgs = self._consumer.consume(self.batch_size, timeout=POLL_TIMEOUT_S)
                if msgs:
                    self._handle(msgs)
                    self._update_lag()
                    self._commit_offsets()
                elif self._assigned:
                    self._update_lag()
                if on_batch is not None:
                    on_batch(self)
        except Stopped:
            log.info("stopped while retrying; the unfinished batch was not applied")
        finally:
            self.close()

    def catch_up(
        self,
        *,
        progress: Callable[[int, int], None] | None = None,
        timeout_s: float | None = None,
    ) -> dict[int, int]:
        """Consume every partition (no group) up to the high watermarks captured now.

        Returns the watermarks reached. Used by rebuild; also a synchronous catch-up.
        """
        self._consumer = self._make_consumer(
            **{"group.id": f"{self.group}.catchup-{uuid.uuid4().hex[:8]}"},
            **{"enable.partition.eof": True},
        )
        try:
            md = self._retry("reading topic metadata", self._metadata)
            parts = sorted(md)
            targets: dict[int, int] = {}
            for p in parts:
                targets[p] = self._retry(f"watermarks of {p}", functools.partial(self._high, p))
            start = self.positions(parts)
            self._next = {p: start[p] + 1 for p in parts}
            begin = dict(self._next)
            total = sum(max(0, targets[p] - begin[p]) for p in parts)
            todo = [p for p in parts if self._next[p] < targets[p]]
            self._assigned = set(todo)
            self._consumer.assign(
                [
                    TopicPartition(
                        self.topic, p, self._next[p] if self._next[p] > 0 else OFFSET_BEGINNING
                    )
                    for p in todo
                ]
            )
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            while any(self._next[p] < targets[p] for p in todo):
                if self._stop.is_set():
                    raise Stopped("stopped before the catch-up finished")
                if deadline is not None and time.monotonic() > deadline:
                    raise KafkaUnavailable(
                        f"catch-up of {self.topic} did not finish in {timeout_s}s"
                    )
                # Bigger batches than live: each touched run is serialised once per batch.
                msgs = self._consumer.consume(max(self.batch_size, CATCH_UP_BATCH), timeout=0.5)
                # Records past the captured watermark belong to the next catch-up.
                self._handle(
                    [
                        m
                        for m in msgs
                        if m.error() is not None or m.offset() < targets[m.partition()]
                    ]
                )
                if progress is not None:
                    done = sum(min(self._next[p], targets[p]) - begin[p] for p in todo)
                    progress(done, total)
            return targets
        finally:
            self.close()

    def _metadata(self) -> dict[int, Any]:
        return partitions_of(self._consumer, self.topic)

    def _high(self, partition: int) -> int:
        return high_watermark(self._consumer, self.topic, partition)

    def close(self) -> None:
        if self._consumer is not None:
            with contextlib.suppress(RuntimeError):  # already closed
                self._consumer.close()
            self._consumer = None
        if self._producer is not None:
            self._producer.flush(10)
            self._producer = None
        self._assigned = set()


def delete_projection(client: redis.Redis, settings: Settings, name: str) -> int:
    """Delete every key of projection ``name`` (its positions too). Returns the count."""
    handler = make_handler(name, settings.redis_key_prefix, settings.events_topic)
    deleted = 0
    batch: list[Any] = []
    for key in client.scan_iter(match=handler.keys.pattern(), count=1000):
        batch.append(key)
        if len(batch) >= 500:
            deleted += int(client.delete(*batch))
            batch = []
    if batch:
        deleted += int(client.delete(*batch))
    return deleted


def rebuild(
    client: redis.Redis,
    settings: Settings,
    names: Sequence[str],
    *,
    progress: Callable[[int, int], None] | None = None,
) -> dict[int, int]:
    """Delete the projections and fold the log from offset zero up to today's watermarks.

    Stop the live services of these projections first: a live runner racing a rebuild is
    safe (WATCH on the positions) but would keep folding after the rebuild's end.
    """
    for name in names:
        try:
            delete_projection(client, settings, name)
        except _TRANSIENT_REDIS as exc:
            raise RedisUnavailable(f"deleting projection {name}: {exc}") from exc
    runner = ProjectionRunner(settings, client, names)
    return runner.catch_up(progress=progress)
