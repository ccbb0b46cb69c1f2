"""The projection runner: Kafka in, pure folds, one atomic Redis write per partition batch.

Exactly-once effects on an at-least-once log: Redis, not Kafka, holds each projection's
position per (topic, partition). A partition batch is applied, for all the runner's
projections at once, as

1. ``WATCH`` every projection's ``pos`` and ``gen``; read them; stop if a generation moved
   (a rebuild) or a position is below what this runner applied (below); drop, per
   projection, the records at or below its position;
2. take the batch's runs from the runner's cache (``store.Handler``), loading only those it
   does not hold; fold the records with each pure projection (a record at or below its
   run's applied offset is skipped);
3. ``MULTI`` -> what the records changed (hash fields, list appends, counters, quarantine
   records) and every ``SET pos`` -> ``EXEC``.

All these keys carry the partition's hash tag, so the transaction stays in one slot.

Effect and position commit together or not at all, so a SIGKILL at any moment loses
nothing and applies nothing twice. ``WATCH`` makes a zombie (a runner that lost the
partition in a rebalance but is still finishing a batch) harmless: if anyone moved the
position meanwhile, EXEC fails and the batch is recomputed from the new position.

On assignment every partition is seeked to ``min(position over the projections) + 1``.
Kafka offset commits are advisory (for ``kafka-consumer-groups`` lag) and never read.

A batch is written only if it continues the stored position. Redis can go back in time (a
failover to a replica that missed the last writes, an AOF that lost its last second, a
key deleted by hand): the position then names an offset below what this runner already
applied, and writing the next batch on top of it would skip the records in between for
good. The runner instead seeks back to the stored position + 1 and refolds from there;
each run's state remembers the offset of its last record (``store.APPLIED``), so records
whose effects survived are not folded twice. The same check runs every few seconds while
a partition is idle.

A rebuild fences live runners: it increments each partition's generation, and a runner
writes only while the generation it read at assignment is still current (checked in the
same transaction as the position). A fenced runner pauses its partitions until the
rebuild's marker is gone, then reads the rebuilt positions and continues from them. A
rebuild that died leaves a second marker, *incomplete* (no TTL): a runner never resumes
on that projection; the first to see it with the rebuild's own marker expired completes
the rebuild from zero (``rebuild``, in a thread beside the paused consumer).

A record that cannot be decoded, or whose key is not its event's run id, is quarantined:
produced (original key, value and headers) to the quarantine topic and acknowledged
*before* the Redis write that records it and advances the position. A crash between the
two re-quarantines it on restart: the topic is at-least-once, Redis exactly-once.
Transient Redis and broker errors are retried with capped exponential backoff; they
never turn into skipped records. Transient includes the replies of a Redis that is up but
cannot take writes now: READONLY (a replica, or a primary demoted by failover), OOM
(``maxmemory`` reached under ``noeviction``), BUSY (a long script), LOADING, MASTERDOWN,
TRYAGAIN.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import gc
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis
from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    KafkaException,
    Producer,
    TopicPartition,
)
from redis.exceptions import MasterDownError, OutOfMemoryError, ReadOnlyError, TryAgainError

from runlog.consumers.notify import Hook, Notifier
from runlog.consumers.queries import incomplete
from runlog.consumers.store import (
    Batch,
    Decoded,
    Handler,
    Rejected,
    Writes,
    dumps,
)
from runlog.consumers.stores import NOTIFY, make_handler
from runlog.errors import (
    KafkaUnavailable,
    RedisUnavailable,
    RegistryUnavailable,
    RunlogError,
    SchemaError,
)
from runlog.log.authority import authority_for, tenant_keys_for
from runlog.log.kafka import group_config, high_watermark, partitions_of
from runlog.log.registry import ids_for
from runlog.projections.run_state import advance
from runlog.schemas.codec import SchemaIds, decode
from runlog.schemas.keys import decode_key
from runlog.schemas.tenant_mac import NO_TENANT_KEYS, TenantKeys
from runlog.settings import Settings

log = logging.getLogger(__name__)

T = TypeVar("T")

BATCH_SIZE = 500
CATCH_UP_BATCH = 5000
POLL_TIMEOUT_S = 0.05
BACKOFF_START_S = 0.05
BACKOFF_CAP_S = 5.0

POSITION_CHECK_S = 2.0
"""How often a live runner compares the stored positions with what it applied."""
REBUILD_MARKER_TTL_S = 30
"""Lifetime of a rebuild's marker unless renewed: a crashed rebuild frees live runners."""
TAKEOVER_RETRY_S = 5.0
"""A runner's attempt to complete a dead rebuild failed: when it tries again."""

_TRANSIENT_REDIS = (redis.ConnectionError, redis.TimeoutError)
# Replies of a Redis that is up but cannot take this write now. redis-py maps some codes
# to classes (stripping the code from the message) and leaves others as ResponseError.
_TRANSIENT_REPLY_CLASSES = (ReadOnlyError, OutOfMemoryError, TryAgainError, MasterDownError)
_TRANSIENT_REPLY_CODES = frozenset({"BUSY", "READONLY", "OOM", "LOADING", "MASTERDOWN", "TRYAGAIN"})


STREAMING_GC_THRESHOLDS = (50_000, 20, 100)
"""A projection process's collector thresholds (``gc.set_threshold``); see ``streaming_gc``."""


def streaming_gc() -> None:
    """Tune this process's cyclic garbage collector for a projection runner.

    Every record allocates a few short-lived containers, so at Python's default threshold
    (700 net allocations) a runner collects hundreds of times a second, and every few
    seconds a full collection walks every cached run state: pauses of 80-220 ms at 5,000
    events/s over 100 runs of 2,000 events, each one straight into the projection lag.
    Counted net of frees, 50,000 is seldom reached by a runner's garbage, which is freed by
    reference counting; cycles are still collected. For a process that runs a projection
    (``runlog project``), not for a library to call behind its host's back.
    """
    gc.set_threshold(*STREAMING_GC_THRESHOLDS)


def transient_redis_error(exc: BaseException) -> bool:
    """True for a Redis failure that passes on its own: retry later, never skip or crash."""
    if isinstance(exc, _TRANSIENT_REDIS + _TRANSIENT_REPLY_CLASSES):
        return True
    if not isinstance(exc, redis.ResponseError):
        return False
    # In a pipeline redis-py prefixes "Command # n (...) of pipeline caused error: ".
    reply = str(exc).rsplit("caused error: ", 1)[-1]
    return reply.split(" ", 1)[0] in _TRANSIENT_REPLY_CODES


class KeyMismatch(SchemaError):
    """A record's Kafka key is not the run id inside its event: it violates the layout."""


class Stopped(RunlogError):
    """The runner was asked to stop while waiting to retry."""


class ProjectionRebuilt(RunlogError):
    """Another rebuild moved a projection's generation while this catch-up was writing it."""


class _PositionRegressed(Exception):
    """The stored position is below what this runner applied: refetch from it."""


class _GenerationMoved(Exception):
    """A rebuild fenced this runner: it must not write the batch."""


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
    regressions: int = 0
    """Times a stored position was found below what this runner had applied (refetched)."""
    fenced: int = 0
    """Batches not written because a rebuild moved the projection's generation."""
    batches: int = 0
    lag: dict[int, int] = field(default_factory=dict)
    """Partition -> high watermark minus next offset, as of the last batch."""


_KEYS: dict[bytes, str] = {}
"""Record keys already checked (``decode_key``) -> their run ids: a run's key repeats on
every record of the run, its check need not."""
_MAX_KEYS = 100_000


def _run_key(raw: Any) -> str:
    if type(raw) is bytes:
        known = _KEYS.get(raw)
        if known is not None:
            return known
    run_id = decode_key(raw)
    if type(raw) is bytes:
        if len(_KEYS) >= _MAX_KEYS:
            _KEYS.clear()
        _KEYS[raw] = run_id
    return run_id


def _record_of(
    msg: Any, ids: SchemaIds | None, tenants: TenantKeys = NO_TENANT_KEYS
) -> Decoded | Rejected:
    partition, offset = msg.partition(), msg.offset()
    try:
        run_key: str | None = _run_key(msg.key())
    except SchemaError as exc:
        # A key that names no run: quarantined, never folded under some run.
        return Rejected(None, partition, offset, type(exc).__name__, str(exc))
    try:
        ev = decode(msg.value(), ids)
        if run_key != ev.run_id:
            raise KeyMismatch(f"record key {run_key!r} is not its event's run id {ev.run_id!r}")
    except SchemaError as exc:
        return Rejected(run_key, partition, offset, type(exc).__name__, str(exc))
    value = msg.value() or b""
    return Decoded(ev, partition, offset, tenants.check(ev.tenant, msg.key(), value, msg.headers()))


def _run_of(rec: Decoded | Rejected) -> str | None:
    return rec.event.run_id if isinstance(rec, Decoded) else rec.run_id


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
        notify: Hook | None = None,
    ) -> None:
        """``notify``: a hook (a Python callable, or ``notify.Webhook``) that ``run`` hands
        each notification the notify projection queues (``consumers.notify``)."""
        if not projections:
            raise ValueError("at least one projection")
        if notify is not None and NOTIFY not in projections:
            raise ValueError(f"a notification hook needs the {NOTIFY!r} projection")
        self.settings = settings
        self.topic = settings.events_topic
        self._ids = ids_for(settings)
        self.redis = client
        self.handlers: list[Handler[Any]] = [
            make_handler(n, settings.redis_key_prefix, self.topic, authority_for(settings))
            for n in projections
        ]
        self.group = group or default_group(settings, projections)
        self.batch_size = batch_size
        self.catch_up_batch = max(batch_size, CATCH_UP_BATCH)
        """Records per batch when behind (and in ``catch_up``): fewer transactions each."""
        self.stats = RunnerStats()
        self._stop = threading.Event()
        self._consumer_extra = dict(consumer_extra or {})
        self._consumer: Any = None
        self._producer: Any = None
        self._assigned: set[int] = set()
        self._next: dict[int, int] = {}
        """Partition -> offset the consumer fetches next (lag, progress)."""
        self._expected: dict[tuple[str, int], int] = {}
        """(projection, partition) -> the position this runner read or wrote last: the
        stored position may only be at or above it."""
        self._gens: dict[tuple[str, int], int] = {}
        """(projection, partition) -> the generation this runner writes under."""
        self._catching_up = False
        self._waiting = False
        """A rebuild fenced this runner: its partitions are paused until it ends."""
        self._checked_at = 0.0
        self._finisher: threading.Thread | None = None
        """Completing a rebuild that died (``_while_waiting``), beside the paused consumer."""
        self._finish_after = 0.0
        self.notify = notify
        self.notifier: Notifier | None = None
        """Delivers the notifications while ``run`` runs (with a ``notify`` hook)."""
        self.deliverable: frozenset[int] = frozenset()
        """Partitions whose notifications this runner's notifier delivers: those assigned
        to it and folded to within a batch of the end of the log. While a partition
        catches up, a decision further on drops its notification instead of racing it."""

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
            except redis.RedisError as exc:
                if not transient_redis_error(exc):
                    raise
                err: Exception = exc
            except (KafkaUnavailable, RegistryUnavailable) as exc:
                # A schema registry that does not answer is an outage, not a verdict on the
                # record: wait for it. A registry that answers "no such id" is the verdict
                # (``UnknownSchemaId``, a ``SchemaError``): the record is quarantined.
                err = exc
            self.stats.retries += 1
            log.warning("%s failed (%s); retrying in %.2fs", what, err, delay)
            if self._stop.wait(delay):
                raise Stopped(f"stopped while retrying {what}") from err
            delay = min(delay * 2, BACKOFF_CAP_S)

    def _forget(self, partition: int) -> None:
        """This runner may no longer be the partition's only writer: drop cached states."""
        for h in self.handlers:
            h.forget(partition)

    # Positions --------------------------------------------------------------------------
    def stored(self, partitions: Iterable[int]) -> dict[tuple[str, int], tuple[int, int]]:
        """(projection, partition) -> (stored position or -1, generation or 0)."""
        parts = sorted(partitions)
        if not parts:
            return {}

        def read() -> list[Any]:
            # One MGET per partition: a partition's keys share a hash tag (one slot of a
            # Redis Cluster), different partitions' keys do not.
            with self.redis.pipeline(transaction=False) as pipe:
                for p in parts:
                    keys = [k for h in self.handlers for k in (h.keys.pos(p), h.keys.gen(p))]
                    # MGET as a raw command: redis-py's cluster pipeline refuses its mget()
                    # helper (made for keys of any slot), but these share one.
                    pipe.execute_command("MGET", *keys)  # type: ignore[no-untyped-call]
                return [v for values in pipe.execute() for v in values]

        raws = iter(self._retry("reading positions", read))
        out: dict[tuple[str, int], tuple[int, int]] = {}
        for p in parts:
            for h in self.handlers:
                pos, gen = next(raws), next(raws)
                out[(h.name, p)] = (
                    int(pos) if pos is not None else -1,
                    int(gen) if gen is not None else 0,
                )
        return out

    def positions(self, partitions: Iterable[int]) -> dict[int, int]:
        """Lowest stored position over this runner's projections, per partition (-1: none)."""
        parts = sorted(partitions)
        got = self.stored(parts)
        return {p: min(got[(h.name, p)][0] for h in self.handlers) for p in parts}

    def _adopt(self, partitions: Iterable[int]) -> dict[int, int]:
        """Read positions and generations, take them as this runner's; min position each."""
        parts = sorted(partitions)
        got = self.stored(parts)
        for key, (pos, gen) in got.items():
            self._expected[key] = pos
            self._gens[key] = gen
        return {p: min(got[(h.name, p)][0] for h in self.handlers) for p in parts}

    def _rebuild_status(self) -> tuple[bool, list[str]]:
        """(a rebuild's marker is present, the projections a dead rebuild left incomplete)."""
        running = [h.keys.rebuild_marker() for h in self.handlers]
        left = [h.keys.incomplete_marker() for h in self.handlers]

        def read() -> list[int]:
            # One EXISTS per marker: the markers of several projections share no slot.
            with self.redis.pipeline(transaction=False) as pipe:
                for key in running + left:
                    pipe.exists(key)
                return [int(n) for n in pipe.execute()]

        found = self._retry("reading rebuild markers", read)
        names = [h.name for h, n in zip(self.handlers, found[len(running) :], strict=True) if n]
        return any(found[: len(running)]), names

    def _rebuild_blocks(self) -> bool:
        running, left = self._rebuild_status()
        return running or bool(left)

    def _while_waiting(self) -> None:
        """Paused for a rebuild: resume once it is over and complete, or complete it.

        A rebuild that died leaves its incomplete marker (``rebuild``): once its own marker
        has expired, this runner refolds those projections from zero (in a thread, so the
        paused consumer keeps its group membership), unless another rebuild took them.
        """
        if self._finisher is not None:
            if self._finisher.is_alive():
                return
            self._finisher = None
        running, left = self._rebuild_status()
        if running:
            return
        if not left:
            self._resume_after_rebuild()
            return
        if time.monotonic() < self._finish_after:
            return
        self._finish_after = time.monotonic() + TAKEOVER_RETRY_S
        log.warning(
            "a rebuild of %s died before it finished: completing it from offset zero",
            "+".join(left),
        )
        self._finisher = threading.Thread(
            target=self._finish_rebuild, args=(left,), name="runlog-finish-rebuild", daemon=True
        )
        self._finisher.start()

    def _finish_rebuild(self, names: list[str]) -> None:
        try:
            rebuild(self.redis, self.settings, names, takeover=True, stop=self._stop)
            log.info("completed the rebuild of %s", "+".join(names))
        except (RebuildBusy, ProjectionRebuilt):
            log.info("another process is rebuilding %s: waiting for it", "+".join(names))
        except Stopped:
            pass
        except Exception as exc:  # noqa: BLE001 - retried later; the marker keeps everyone out
            log.warning(
                "completing the rebuild of %s failed (%s); trying again in %.0fs",
                "+".join(names),
                exc,
                TAKEOVER_RETRY_S,
            )

    def _seek(self, partition: int, pos: int) -> None:
        """Make the consumer fetch ``partition`` from ``pos + 1`` (its beginning if -1)."""
        offset = pos + 1 if pos >= 0 else OFFSET_BEGINNING

        def seek() -> None:
            try:
                self._consumer.seek(TopicPartition(self.topic, partition, offset))
            except KafkaException as exc:
                raise KafkaUnavailable(
                    f"seek {self.topic}[{partition}] to {offset}: {exc}"
                ) from exc

        self._retry(f"seeking {self.topic}[{partition}]", seek)
        self._next[partition] = max(pos + 1, 0)

    def _rewind(self, partition: int) -> None:
        """The stored position went back: refetch the partition from it."""
        self.stats.regressions += 1
        self._forget(partition)
        pos = self._adopt([partition])[partition]
        log.warning(
            "stored position of %s[%s] went back to %s (Redis lost writes, or a key was "
            "deleted): refetching from there",
            self.topic,
            partition,
            pos,
        )
        self._seek(partition, pos)

    def _check_positions(self) -> None:
        """Between batches: a position that went back is refetched even with no traffic."""
        parts = sorted(self._assigned)
        if not parts or self._waiting:
            return
        got = self.stored(parts)
        if incomplete_left := self._rebuild_status()[1]:
            # A rebuild died before its generations moved: nothing deleted yet, but what
            # the next rebuild or runner refolds must not be written meanwhile.
            log.warning("%s marked incomplete by a dead rebuild: pausing", incomplete_left)
            self._wait_for_rebuild(self._consumer)
            return
        for p in parts:
            for h in self.handlers:
                key = (h.name, p)
                pos, gen = got[key]
                if gen != self._gens.get(key, 0):
                    self._fenced(p)
                    return
                if pos < self._expected.get(key, -1):
                    self._rewind(p)
                    break

    def _on_assign(self, consumer: Any, partitions: list[Any]) -> None:
        # Generations before the markers: a rebuild sets its marker before it moves them.
        pos = self._adopt(tp.partition for tp in partitions)
        for tp in partitions:
            self._forget(tp.partition)
            p = pos[tp.partition]
            tp.offset = p + 1 if p >= 0 else OFFSET_BEGINNING
            self._next[tp.partition] = max(p + 1, 0)
        consumer.assign(partitions)
        self._assigned |= {tp.partition for tp in partitions}
        log.info("assigned %s", {tp.partition: tp.offset for tp in partitions})
        if self._waiting or self._rebuild_blocks():
            self._wait_for_rebuild(consumer)

    def _caught_up(self) -> None:
        """``deliverable`` from the lag measured after the last batch (or poll)."""
        self.deliverable = frozenset(
            p
            for p in self._assigned
            if not self._waiting and self.stats.lag.get(p, self.batch_size) < self.batch_size
        )

    def _on_revoke(self, consumer: Any, partitions: list[Any]) -> None:
        # Batches are applied between polls, so none is in flight here; a batch whose
        # partition was revoked during the poll that returned it is dropped (below) and
        # the new owner applies it from the stored position.
        self._assigned -= {tp.partition for tp in partitions}
        self.deliverable -= {tp.partition for tp in partitions}
        for tp in partitions:
            self.stats.lag.pop(tp.partition, None)
            self._forget(tp.partition)
        log.info("revoked %s", sorted(tp.partition for tp in partitions))

    # Rebuild fencing --------------------------------------------------------------------
    def _fenced(self, partition: int) -> None:
        """A rebuild moved the generation of ``partition``: stop writing until it ends."""
        self.stats.fenced += 1
        if self._catching_up:
            raise ProjectionRebuilt(
                f"a rebuild of {'+'.join(h.name for h in self.handlers)} started while this "
                f"catch-up was writing {self.topic}[{partition}]; it stopped without writing"
            )
        log.warning(
            "a rebuild fenced this runner at %s[%s]: pausing until it finishes",
            self.topic,
            partition,
        )
        self._wait_for_rebuild(self._consumer)

    def _wait_for_rebuild(self, consumer: Any) -> None:
        self._waiting = True
        tps = [TopicPartition(self.topic, p) for p in sorted(self._assigned)]
        if tps:
            consumer.pause(tps)

    def _resume_after_rebuild(self) -> None:
        """The rebuild is over: continue from the positions it wrote, under its generation."""
        parts = sorted(self._assigned)
        pos = self._adopt(parts)
        for p in parts:
            self._forget(p)
            self._seek(p, pos[p])
        if parts:
            self._consumer.resume([TopicPartition(self.topic, p) for p in parts])
        self._waiting = False
        log.info("rebuild finished: continuing from %s", {p: pos[p] + 1 for p in parts})

    # Kafka ------------------------------------------------------------------------------
    def _make_consumer(self, **extra: Any) -> Any:
        conf = group_config(self.settings, self.group, **{**self._consumer_extra, **extra})
        return Consumer(conf, logger=log)

    def _quarantine_producer(self) -> Any:
        if self._producer is None:
            self._producer = Producer(self.settings.durable_producer_config(), logger=log)
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
    def _apply_partition(self, partition: int, msgs: list[Any]) -> bool:
        """Apply one partition's batch; False if it was not written and must be refetched
        (the stored position went back) or held back (a rebuild fenced this runner)."""
        tenants = tenant_keys_for(self.settings)
        if self._ids is None:
            recs = [_record_of(m, None, tenants) for m in msgs]
        else:
            # Decoding may ask the schema registry for an id this process has not seen;
            # while it does not answer, the batch waits (capped backoff), never skipped.
            recs = self._retry(
                f"decoding {self.topic}[{partition}] (schema registry {self._ids.url})",
                functools.partial(self._decode_all, msgs, tenants),
            )
        rejected = {r.offset: r for r in recs if isinstance(r, Rejected)}
        if rejected:
            low = self.positions([partition])[partition]
            todo = [m for m in msgs if m.offset() in rejected and m.offset() > low]
            if todo:
                self._produce_quarantined(todo, rejected)
        raw = {m.offset(): m for m in msgs}
        try:
            self._retry(
                f"applying {'+'.join(h.name for h in self.handlers)} to {self.topic}[{partition}]",
                functools.partial(self._commit, partition, recs, raw),
            )
        except _PositionRegressed:
            self._rewind(partition)
            return False
        except _GenerationMoved:
            self._fenced(partition)
            return False
        return True

    def _decode_all(self, msgs: list[Any], tenants: TenantKeys) -> list[Decoded | Rejected]:
        return [_record_of(m, self._ids, tenants) for m in msgs]

    def _commit(self, partition: int, recs: list[Decoded | Rejected], raw: dict[int, Any]) -> None:
        """Every projection's effects and position for one partition batch, in one
        MULTI/EXEC: one round of WATCH, reads and EXEC per partition, not per projection.
        Every key it touches carries the partition's hash tag (one Redis Cluster slot)."""
        watched = [k for h in self.handlers for k in (h.keys.pos(partition), h.keys.gen(partition))]
        while True:
            with self.redis.pipeline(transaction=True) as pipe:
                try:
                    pipe.watch(*watched)  # type: ignore[no-untyped-call]
                    values = iter(pipe.execute_command("MGET", *watched))  # type: ignore[no-untyped-call]
                    plans: list[tuple[Handler[Any], list[Decoded | Rejected], int]] = []
                    for handler in self.handlers:
                        me = (handler.name, partition)
                        stored, gen_raw = next(values), next(values)
                        pos = int(stored) if stored is not None else -1
                        if (int(gen_raw) if gen_raw is not None else 0) != self._gens.get(me, 0):
                            raise _GenerationMoved
                        if pos < self._expected.get(me, -1):
                            # Writing on top would skip the records between pos and what
                            # we applied, for good: refetch from pos instead.
                            raise _PositionRegressed
                        if pos != self._expected.get(me, -1):
                            # Another writer moved the position: the cached states are stale.
                            handler.forget(partition)
                        todo = [r for r in recs if r.offset > pos]
                        plans.append((handler, todo, pos))
                    writes = self._fold_all(pipe, partition, plans)
                    shared = Writes()
                    pipe.multi()
                    for (handler, todo, _), (batch, took) in zip(plans, writes, strict=True):
                        if todo:
                            self._queue_writes(
                                pipe, partition, handler, batch, took, todo, raw, shared
                            )
                    if any(todo for _, todo, _ in plans):
                        pipe.execute()
                except redis.WatchError:
                    # Someone else (a zombie, a rebuild) moved a position: recompute.
                    self.stats.watch_conflicts += 1
                    self._forget(partition)
                    continue
                except BaseException:
                    # The folds mutated cached states, and the EXEC may or may not have
                    # happened: only Redis knows now.
                    self._forget(partition)
                    raise
            for (handler, todo, pos), (batch, took) in zip(plans, writes, strict=True):
                me = (handler.name, partition)
                self.stats.skipped += len(recs) - len(todo)
                if not todo:
                    self._expected[me] = pos
                    continue
                if batch is not None:
                    handler.committed(batch)
                self._expected[me] = todo[-1].offset
                self.stats.applied[handler.name] += sum(1 for r in took if isinstance(r, Decoded))
                self.stats.quarantined += sum(1 for r in took if isinstance(r, Rejected))
                self.stats.skipped += len(todo) - len(took)
            return

    def _fold_all(
        self,
        pipe: Any,
        partition: int,
        plans: list[tuple[Handler[Any], list[Decoded | Rejected], int]],
    ) -> list[tuple[Batch[Any] | None, list[Decoded | Rejected]]]:
        """Fold every projection's ``todo`` into its runs; per projection, the batch and
        the records it took.

        Each run's state is folded once per record: the projections whose copies of it
        are at the same record (always, unless one was rebuilt or reset alone) share one
        copy, and each gets the same ``Step``. Others fold their own copy.
        """
        batches: list[Batch[Any] | None] = []
        for handler, todo, _ in plans:
            if not todo:
                batches.append(None)
                continue
            run_ids = sorted({rid for r in todo if (rid := _run_of(r)) is not None})
            batches.append(handler.begin(self.redis, partition, run_ids))
        active = [
            (h, todo, b) for (h, todo, _), b in zip(plans, batches, strict=True) if b is not None
        ]
        shared: set[str] = set()
        if len(active) > 1:
            # The copy to share: the one with the conversation, if a projection keeps it.
            order = sorted(active, key=lambda a: not a[0].full)
            for rid in order[0][2].states:
                holders = [(h, b) for h, _, b in order if rid in b.states]
                if len(holders) != len(order) or len({b.offsets[rid] for _, b in holders}) != 1:
                    continue
                first = holders[0][0].validator(holders[0][1].states[rid])
                for h, b in holders[1:]:
                    h.share(b.states[rid], first)
                shared.add(rid)
        # A record that names no run leaves no trace in any run's state; its quarantine
        # entry (keyed by offset) is what says it was applied.
        recorded: dict[int, set[int]] = {}
        for i, (handler, todo, _) in enumerate(active):
            orphans = [r for r in todo if isinstance(r, Rejected) and r.run_id is None]
            if orphans:
                present = pipe.hmget(
                    handler.keys.quarantine(partition), [str(r.offset) for r in orphans]
                )
                recorded[i] = {
                    r.offset for r, v in zip(orphans, present, strict=True) if v is not None
                }
        took: list[list[Decoded | Rejected]] = [[] for _ in active]
        # Usually every projection is at the same position: then they all have the same
        # records to do, and a shared run's record is taken by all of them or by none.
        uniform = len({pos for (_, todo, pos) in plans if todo}) == 1
        todos = [{r.offset for r in todo} for _, todo, _ in active]
        records = sorted({r.offset: r for _, todo, _ in active for r in todo}.items())
        for offset, rec in records:
            if uniform and isinstance(rec, Decoded) and rec.event.run_id in shared:
                ev = rec.event
                h0, _, b0 = active[0]
                if offset <= b0.offsets.get(ev.run_id, -1):
                    continue
                step = advance(h0.validator(b0.states[ev.run_id]), ev, rec.forged)
                for i, (h, _, b) in enumerate(active):
                    h.step(b, rec, step)
                    took[i].append(rec)
                continue
            takers = [
                i for i, (h, _, b) in enumerate(active) if offset in todos[i] and h.takes(b, rec)
            ]
            if isinstance(rec, Rejected):
                for i, (h, _, b) in enumerate(active):
                    if i in takers:
                        h.reject(b, rec)
                        took[i].append(rec)
                    elif (
                        rec.run_id is None
                        and offset in todos[i]
                        and offset not in recorded.get(i, ())
                    ):
                        took[i].append(rec)
                continue
            if not takers:
                continue
            ev = rec.event
            if ev.run_id in shared:
                if len(takers) != len(active):  # pragma: no cover - equal offsets, same records
                    raise RuntimeError(f"projections sharing run {ev.run_id} disagree at {offset}")
                h0, _, b0 = active[takers[0]]
                step = advance(h0.validator(b0.states[ev.run_id]), ev, rec.forged)
                for i in takers:
                    h, _, b = active[i]
                    h.step(b, rec, step)
                    took[i].append(rec)
            else:
                for i in takers:
                    h, _, b = active[i]
                    h.step(b, rec, advance(h.validator(b.states[ev.run_id]), ev, rec.forged))
                    took[i].append(rec)
        out: list[tuple[Batch[Any] | None, list[Decoded | Rejected]]] = []
        it = iter(took)
        for maybe in batches:
            out.append((None, []) if maybe is None else (maybe, next(it)))
        return out

    def _queue_writes(
        self,
        pipe: Any,
        partition: int,
        handler: Handler[Any],
        batch: Batch[Any] | None,
        took: list[Decoded | Rejected],
        todo: list[Decoded | Rejected],
        raw: dict[int, Any],
        shared: Writes,
    ) -> None:
        """One projection's effects and its position (inside the partition's MULTI)."""
        keys = handler.keys
        if batch is not None:
            handler.write(pipe, batch, shared)
        applied = sum(1 for r in took if isinstance(r, Decoded))
        bad = [r for r in took if isinstance(r, Rejected)]
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
        pipe.set(keys.pos(partition), todo[-1].offset)

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
            if self._waiting:
                return  # fenced by a rebuild: nothing more is written until it ends
            if self._apply_partition(partition, part_msgs):
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

    def _take(self, size: int) -> list[Any]:
        """Up to ``size`` records as soon as there is one: the first waits at most
        ``POLL_TIMEOUT_S``, the rest are those already fetched behind it. consume() alone
        waits for a full batch or its timeout, and under a steady load that wait is the
        projection's lag; a backlog still comes in full batches."""
        first = self._consumer.poll(POLL_TIMEOUT_S)
        if first is None:
            return []
        return [first, *(self._consumer.consume(size - 1, timeout=0) if size > 1 else ())]

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
        behind = False
        if self.notify is not None:
            self.notifier = Notifier(
                self.redis, self.settings, self.notify, partitions=lambda: self.deliverable
            ).start()
        try:
            while not self._stop.is_set():
                if self._waiting:
                    # Paused partitions return nothing; polling keeps the group membership.
                    self._consumer.consume(self.batch_size, timeout=0.2)
                    self._while_waiting()
                    continue
                # A full batch means a backlog: then take catch-up sized ones, fewer
                # transactions each.
                size = self.catch_up_batch if behind else self.batch_size
                msgs = self._take(size)
                behind = len(msgs) >= size
                if msgs:
                    self._handle(msgs)
                    self._update_lag()
                    self._commit_offsets()
                elif self._assigned:
                    self._update_lag()
                if time.monotonic() - self._checked_at > POSITION_CHECK_S:
                    self._checked_at = time.monotonic()
                    self._check_positions()
                self._caught_up()
                if on_batch is not None:
                    on_batch(self)
        except Stopped:
            log.info("stopped while retrying; the unfinished batch was not applied")
        finally:
            if self._finisher is not None:
                # It sees the same stop; what it had not refolded stays marked incomplete.
                self._finisher.join(timeout=30)
            if self.notifier is not None:
                self.notifier.stop()
            self.close()

    def catch_up(
        self,
        *,
        progress: Callable[[int, int], None] | None = None,
        timeout_s: float | None = None,
        generations: dict[tuple[str, int], int] | None = None,
    ) -> dict[int, int]:
        """Consume every partition (no group) up to the high watermarks captured now.

        Returns the watermarks reached. Used by rebuild (``generations``: the ones it
        fenced the live runners with); also a synchronous catch-up.
        """
        self._catching_up = True
        self._consumer = self._make_consumer(
            **{"group.id": f"{self.group}.catchup-{uuid.uuid4().hex[:8]}"},
            **{"enable.partition.eof": True},
        )
        try:
            names = [h.name for h in self.handlers]
            broken = (
                []
                if generations is not None
                else self._retry(
                    "reading rebuild markers",
                    functools.partial(incomplete, self.redis, self.settings, names),
                )
            )
            if broken:
                raise RebuildIncomplete(
                    f"a rebuild of {'+'.join(broken)} died before it finished: the projection is "
                    f"half deleted or half refolded; run `runlog rebuild` (or start a runner)"
                )
            md = self._retry("reading topic metadata", self._metadata)
            parts = sorted(md)
            targets: dict[int, int] = {}
            for p in parts:
                targets[p] = self._retry(f"watermarks of {p}", functools.partial(self._high, p))
            start = self._adopt(parts)
            if generations is not None:
                self._gens.update(generations)
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
                # Bigger batches than live: fewer transactions. consume() returns when it
                # has as many messages as asked or its timeout ends: never ask for more
                # than are left, or the last batch waits out the whole timeout.
                left = sum(max(0, targets[p] - self._next[p]) for p in todo)
                size = max(1, min(self.catch_up_batch, left))
                msgs = self._consumer.consume(size, timeout=0.5)
                # Records past the captured watermark belong to the next catch-up.
                self._handle(
                    [
                        m
                        for m in msgs
                        if m.error() is not None or m.offset() < targets[m.partition()]
                    ]
                )
                if progress is not None:
                    done = sum(max(0, min(self._next[p], targets[p]) - begin[p]) for p in todo)
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
    """Delete every key of projection ``name`` (its positions too). Returns the count.

    The generations and the rebuild marker are outside the pattern and stay.
    """
    handler = make_handler(
        name, settings.redis_key_prefix, settings.events_topic, authority_for(settings)
    )
    deleted = 0
    batch: list[Any] = []
    # SCAN visits every master of a Redis Cluster; the keys found span many slots, so
    # they are deleted one command each (pipelined), not in one DEL.
    for key in client.scan_iter(match=handler.keys.pattern(), count=1000):
        batch.append(key)
        if len(batch) >= 500:
            deleted += _delete(client, batch)
            batch = []
    if batch:
        deleted += _delete(client, batch)
    return deleted


def _delete(client: redis.Redis, keys: list[Any]) -> int:
    with client.pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.delete(key)
        return sum(int(n) for n in pipe.execute())


def _ours(raw: Any, value: str) -> bool:
    return (raw.decode() if isinstance(raw, bytes) else raw) == value


def _delete_if_ours(client: redis.Redis, key: str, value: str) -> None:
    """Delete a marker only if it still holds this rebuild's value.

    WATCH and MULTI, not a script: projection services may not run scripts (their Redis
    ACL, ``runlog.security``), and they complete dead rebuilds. One key: any slot.
    """
    with client.pipeline(transaction=True) as pipe:
        try:
            pipe.watch(key)  # type: ignore[no-untyped-call]
            if not _ours(pipe.get(key), value):
                return
            pipe.multi()
            pipe.delete(key)
            pipe.execute()
        except redis.WatchError:
            pass  # changed meanwhile: another rebuild's now


def _renew_if_ours(client: redis.Redis, key: str, value: str) -> None:
    """Renew a marker unless another rebuild has taken it over since."""
    with client.pipeline(transaction=True) as pipe:
        try:
            pipe.watch(key)  # type: ignore[no-untyped-call]
            raw = pipe.get(key)
            if raw is not None and not _ours(raw, value):
                return
            pipe.multi()
            pipe.set(key, value, ex=REBUILD_MARKER_TTL_S)
            pipe.execute()
        except redis.WatchError:
            pass


class RebuildBusy(RunlogError):
    """Another process is rebuilding the projection (a runner's takeover stands aside)."""


class RebuildIncomplete(RunlogError):
    """A rebuild of the projection died before it finished: rebuild it (or start a runner)."""


class _RebuildMarker:
    """The rebuild's marker on each projection, renewed while it runs.

    Live runners wait while it exists; its TTL frees them if the rebuild dies. Whether they
    then continue or refold is the incomplete marker's to say (``rebuild``). ``exclusive``:
    take the markers only if no other rebuild holds one (a runner completing a dead
    rebuild), else ``RebuildBusy``; an operator's rebuild takes them regardless.
    """

    def __init__(self, client: redis.Redis, keys: list[str], *, exclusive: bool = False) -> None:
        self.client = client
        self.keys = keys
        self.exclusive = exclusive
        self.value = json.dumps(
            {
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "started_at": time.time(),
                "id": uuid.uuid4().hex,
            }
        )
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._renew, name="runlog-rebuild", daemon=True)

    def _set(self) -> None:
        # Not one MULTI: the markers of several projections share no Redis Cluster slot.
        with self.client.pipeline(transaction=False) as pipe:
            for key in self.keys:
                pipe.set(key, self.value, ex=REBUILD_MARKER_TTL_S)
            pipe.execute()

    def _take(self) -> None:
        taken: list[str] = []
        for key in self.keys:
            if not self.client.set(key, self.value, ex=REBUILD_MARKER_TTL_S, nx=True):
                for k in taken:
                    _delete_if_ours(self.client, k, self.value)
                raise RebuildBusy(f"another rebuild holds {key}")
            taken.append(key)

    def _renew(self) -> None:
        while not self._done.wait(REBUILD_MARKER_TTL_S / 6):
            try:
                for key in self.keys:
                    _renew_if_ours(self.client, key, self.value)
            except redis.RedisError as exc:  # the next renewal may pass; the TTL is long
                log.warning("renewing the rebuild marker failed: %s", exc)

    def __enter__(self) -> _RebuildMarker:
        if self.exclusive:
            self._take()
        else:
            self._set()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(timeout=5)
        for key in self.keys:
            # A later rebuild may have taken the marker over: it is its own to remove.
            _delete_if_ours(self.client, key, self.value)


def rebuild(
    client: redis.Redis,
    settings: Settings,
    names: Sequence[str],
    *,
    progress: Callable[[int, int], None] | None = None,
    takeover: bool = False,
    stop: threading.Event | None = None,
) -> dict[int, int]:
    """Delete the projections and fold the log from offset zero up to today's watermarks.

    Live runners of these projections are fenced, not raced: the rebuild first marks the
    projections as rebuilding, then increments every partition's generation (a live
    runner's next write fails its generation check, in the same transaction as its
    position), deletes the keys and folds. Fenced runners pause until the marker is gone,
    then continue from the rebuilt positions.

    A rebuild can die anywhere (SIGKILL, ^C, a lost host), and deleting thousands of keys
    and refolding them cannot be one atomic write. So, before its first delete, it sets a
    second marker per projection, *incomplete*, with no TTL, and removes it only once the
    refold reached the watermarks. While it exists no runner writes the projection and a
    plain catch-up refuses it (``RebuildIncomplete``); once the rebuild's own marker has
    expired, the first runner that sees it completes the rebuild from zero (``takeover``:
    only if no other rebuild holds the marker), as does the operator's next rebuild.

    Why a durable marker and not a new generation of keys switched by a pointer at the
    end: every reader (``runlog state``, the run index, the UI, dashboards reading the
    documented layout) reads a projection's keys where they are, and a Redis Cluster
    cannot switch many slots' keys at once, so a pointer would be read by every query and
    a rebuild would hold two copies of the projection. Readers of an incomplete projection
    are told so (``incomplete``); they are never shown it as current by a runner resuming.
    """
    handlers = [
        make_handler(n, settings.redis_key_prefix, settings.events_topic, authority_for(settings))
        for n in names
    ]
    parts = range(settings.partitions)
    try:
        with _RebuildMarker(
            client, [h.keys.rebuild_marker() for h in handlers], exclusive=takeover
        ) as marker:
            # Durable before anything is deleted: from here on, a death leaves the
            # projection marked incomplete, never silently half deleted. One SET per key
            # (several projections share no slot); a death between them leaves the rest
            # intact, their generations not moved yet.
            with client.pipeline(transaction=False) as pipe:
                for h in handlers:
                    pipe.set(h.keys.incomplete_marker(), marker.value)
                pipe.execute()
            # Each generation fences its own partition (checked in that partition's
            # transactions), so they need not move together: one INCR per key, not one
            # MULTI (which a Redis Cluster refuses across slots).
            with client.pipeline(transaction=False) as pipe:
                for h in handlers:
                    for p in parts:
                        pipe.incr(h.keys.gen(p))
                gens = iter(pipe.execute())
            generations = {(h.name, p): int(next(gens)) for h in handlers for p in parts}
            for name in names:
                delete_projection(client, settings, name)
            runner = ProjectionRunner(settings, client, names)
            if stop is not None:
                runner._stop = stop
            targets = runner.catch_up(progress=progress, generations=generations)
            # Complete: only now may runners trust and write the projection again. Only
            # our own mark: one set by a rebuild that started since is that one's to clear.
            for h in handlers:
                _delete_if_ours(client, h.keys.incomplete_marker(), marker.value)
            return targets
    except redis.RedisError as exc:
        raise RedisUnavailable(f"rebuilding {', '.join(names)}: {exc}") from exc
