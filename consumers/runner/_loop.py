"""The consumer loop: ``ProjectionRunner``, a group member (``run``) or a catch-up to
today's watermarks (``catch_up``) that owns the consumer and the runner's collaborators
(positions, the rebuild fence, the batch applier) and feeds partition batches to the
applier; and ``rebuild``, which folds with a runner of its own.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import redis
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, TopicPartition

from runlog._settings import Settings
from runlog.consumers._notify import Hook, Notifier
from runlog.consumers._queries import incomplete
from runlog.consumers._store import Handler
from runlog.consumers.runner._batch import BatchApplier, PositionStore, Retrier, Verdict
from runlog.consumers.runner._core import BATCH_SIZE, RunnerStats, Stopped, default_group
from runlog.consumers.runner._fencing import ProjectionRebuilt, RebuildFence, RebuildIncomplete
from runlog.consumers.runner._rebuilding import rebuild_with
from runlog.consumers.stores import NOTIFY, make_handler
from runlog.errors import KafkaUnavailable
from runlog.log._authority import authority_for
from runlog.log._kafka import group_config, high_watermark, partitions_of

log = logging.getLogger(__name__)

CATCH_UP_BATCH = 5000
POLL_TIMEOUT_S = 0.05
POSITION_CHECK_S = 2.0
"""How often a live runner compares the stored positions with what it applied."""

STREAMING_GC_THRESHOLDS = (50_000, 20, 100)
"""A runlog process's collector thresholds (``gc.set_threshold``); see ``streaming_gc``."""


def streaming_gc() -> None:
    """Tune this process's cyclic garbage collector for a process that streams events: a
    projection runner (``runlog project``) or a worker (``runlog worker``).

    Every record, and every step, allocates a few short-lived containers, so at Python's
    default threshold (700 net allocations) such a process collects hundreds of times a
    second, and every few seconds a full collection walks everything the process holds: in
    a runner every cached run state (pauses of 80-220 ms at 5,000 events/s over 100 runs
    of 2,000 events, each one straight into the projection lag); in a worker also its
    agents' frameworks (a worker that had imported LangGraph, DBOS, Pydantic AI and the
    OpenAI Agents SDK spent 0.29 ms of CPU per safe step with 100 runs at once, 0.14-0.15
    ms with these thresholds). Counted net of frees, 50,000 is seldom reached by this
    garbage, which is freed by reference counting; cycles are still collected. For the
    process's entry point to call, not for a library to call behind its host's back.
    """
    gc.set_threshold(*STREAMING_GC_THRESHOLDS)


class ProjectionRunner:
    """Runs one or more projections off one consumer (fan-out, one position each).

    The consumer loop, composed of collaborators it owns, each with one job: a
    ``Retrier`` (transient failures), the ``PositionStore`` (positions and generations,
    and whether one may be written on), the ``RebuildFence`` (rebuild markers, completing
    a dead rebuild) and the ``BatchApplier`` (decode, quarantine, fold, commit). The loop
    alone touches the consumer: it assigns, seeks, pauses and resumes.

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
        stop: threading.Event | None = None,
    ) -> None:
        """``notify``: a hook (a Python callable, or ``notify.Webhook``) that ``run`` hands
        each notification the notify projection queues (``consumers._notify``). ``stop``:
        an event that stops this runner when set (``rebuild``'s caller's), else its own."""
        if not projections:
            raise ValueError("at least one projection")
        if notify is not None and NOTIFY not in projections:
            raise ValueError(f"a notification hook needs the {NOTIFY!r} projection")
        self.settings = settings
        self.topic = settings.events_topic
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
        self._stop = stop if stop is not None else threading.Event()
        self.retrier = Retrier(self._stop, self.stats)
        self.positions = PositionStore(client, self.handlers, self.retrier)
        self.fence = RebuildFence(client, self.handlers, self.retrier, refold=self._refold)
        self.applier = BatchApplier(
            settings,
            client,
            self.handlers,
            positions=self.positions,
            retrier=self.retrier,
            stats=self.stats,
            group=self.group,
        )
        self._consumer_extra = dict(consumer_extra or {})
        self._consumer: Any = None
        self._assigned: set[int] = set()
        self._next: dict[int, int] = {}
        """Partition -> offset the consumer fetches next (lag, progress)."""
        self._catching_up = False
        self._waiting = False
        """A rebuild fenced this runner: its partitions are paused until it ends."""
        self._checked_at = 0.0
        self.notify = notify
        self.notifier: Notifier | None = None
        """Delivers the notifications while ``run`` runs (with a ``notify`` hook)."""
        self.deliverable: frozenset[int] = frozenset()
        """Partitions whose notifications this runner's notifier delivers: those assigned
        to it and folded to within a batch of the end of the log. While a partition
        catches up, a decision further on drops its notification instead of racing it."""

    # Control ----------------------------------------------------------------------
    def stop(self) -> None:
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def _refold(self, names: list[str]) -> None:
        """Complete a rebuild that died (the fence's ``refold``)."""
        rebuild(self.redis, self.settings, names, takeover=True, stop=self._stop)

    # Positions --------------------------------------------------------------------
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

        self.retrier.retry(f"seeking {self.topic}[{partition}]", seek)
        self._next[partition] = max(pos + 1, 0)

    def _rewind(self, partition: int) -> None:
        """The stored position went back: refetch the partition from it."""
        self.stats.regressions += 1
        self.applier.forget(partition)
        pos = self.positions.adopt([partition])[partition]
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
        got = self.positions.stored(parts)
        if incomplete_left := self.fence.status()[1]:
            # A rebuild died before its generations moved: nothing deleted yet, but what
            # the next rebuild or runner refolds must not be written meanwhile.
            log.warning("%s marked incomplete by a dead rebuild: pausing", incomplete_left)
            self._pause(self._consumer)
            return
        for p in parts:
            for h in self.handlers:
                verdict = self.positions.verdict(h.name, p, *got[(h.name, p)])
                if verdict is Verdict.FENCED:
                    self._fenced(p)
                    return
                if verdict is Verdict.REGRESSED:
                    self._rewind(p)
                    break

    # Rebuilds ---------------------------------------------------------------------
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
        self._pause(self._consumer)

    def _pause(self, consumer: Any) -> None:
        self._waiting = True
        tps = [TopicPartition(self.topic, p) for p in sorted(self._assigned)]
        if tps:
            consumer.pause(tps)

    def _resume_after_rebuild(self) -> None:
        """The rebuild is over: continue from the positions it wrote, under its generation."""
        parts = sorted(self._assigned)
        pos = self.positions.adopt(parts)
        for p in parts:
            self.applier.forget(p)
            self._seek(p, pos[p])
        if parts:
            self._consumer.resume([TopicPartition(self.topic, p) for p in parts])
        self._waiting = False
        log.info("rebuild finished: continuing from %s", {p: pos[p] + 1 for p in parts})

    # Assignment -------------------------------------------------------------------
    def _on_assign(self, consumer: Any, partitions: list[Any]) -> None:
        # Generations before the markers: a rebuild sets its marker before it moves them.
        pos = self.positions.adopt(tp.partition for tp in partitions)
        for tp in partitions:
            self.applier.forget(tp.partition)
            p = pos[tp.partition]
            tp.offset = p + 1 if p >= 0 else OFFSET_BEGINNING
            self._next[tp.partition] = max(p + 1, 0)
        consumer.assign(partitions)
        self._assigned |= {tp.partition for tp in partitions}
        log.info("assigned %s", {tp.partition: tp.offset for tp in partitions})
        if self._waiting or self.fence.blocks():
            self._pause(consumer)
        else:
            # librdkafka keeps a partition's pause across its revocation and a later
            # assignment: one paused for a rebuild that ended while it was revoked (its
            # resume then named no partition) would stay paused for ever.
            consumer.resume([TopicPartition(self.topic, tp.partition) for tp in partitions])

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
            self.applier.forget(tp.partition)
        log.info("revoked %s", sorted(tp.partition for tp in partitions))

    # Kafka ------------------------------------------------------------------------
    def _make_consumer(self, **extra: Any) -> Any:
        conf = group_config(self.settings, self.group, **{**self._consumer_extra, **extra})
        return Consumer(conf, logger=log)

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
            verdict = self.applier.apply(partition, part_msgs)
            if verdict is Verdict.CURRENT:
                self._next[partition] = part_msgs[-1].offset() + 1
                self.stats.batches += 1
            elif verdict is Verdict.REGRESSED:
                self._rewind(partition)
            else:
                self._fenced(partition)

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

    # Main loops -------------------------------------------------------------------
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
                    if self.fence.over():
                        self._resume_after_rebuild()
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
                if not behind:
                    self.applier.settle_erasures()
                if time.monotonic() - self._checked_at > POSITION_CHECK_S:
                    self._checked_at = time.monotonic()
                    self._check_positions()
                self._caught_up()
                if on_batch is not None:
                    on_batch(self)
        except Stopped:
            log.info("stopped while retrying; the unfinished batch was not applied")
        finally:
            # A dead rebuild being completed sees the same stop; what it had not refolded
            # stays marked incomplete.
            self.fence.join(timeout=30)
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
                else self.retrier.retry(
                    "reading rebuild markers",
                    functools.partial(incomplete, self.redis, self.settings, names),
                )
            )
            if broken:
                raise RebuildIncomplete(
                    f"a rebuild of {'+'.join(broken)} died before it finished: the projection is "
                    f"half deleted or half refolded; run `runlog rebuild` (or start a runner)"
                )
            md = self.retrier.retry("reading topic metadata", self._metadata)
            parts = sorted(md)
            targets: dict[int, int] = {}
            for p in parts:
                targets[p] = self.retrier.retry(
                    f"watermarks of {p}", functools.partial(self._high, p)
                )
            start = self.positions.adopt(parts)
            if generations is not None:
                self.positions.write_under(generations)
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
            self.applier.settle_erasures()
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
        self.applier.close()
        self._assigned = set()


def rebuild(
    client: redis.Redis,
    settings: Settings,
    names: Sequence[str],
    *,
    progress: Callable[[int, int], None] | None = None,
    takeover: bool = False,
    stop: threading.Event | None = None,
) -> dict[int, int]:
    """Rebuild projections ``names`` from offset zero, live runners fenced, not raced
    (``rebuilding.rebuild_with``, which says how a rebuild that dies is completed)."""
    return rebuild_with(
        lambda: ProjectionRunner(settings, client, names, stop=stop),
        client,
        settings,
        names,
        progress=progress,
        takeover=takeover,
    )
