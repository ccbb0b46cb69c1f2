"""One Kafka producer shared by every run in a process, with an outcome per append.

Many runs pipeline through one idempotent producer, so throughput grows with
concurrency; each append still gets its own acknowledgement (filled in by the delivery
report), and a durability barrier waits for those of its appends together (``AckGroup``).

Who serves delivery reports decides what a barrier costs. One role, held by one thread at a
time (``EventWriter._serving``): a barrier that finds it free serves its own reports with a
``flush`` in its own thread (which also sends what is queued at once, ignoring the linger)
until its acknowledgements are in, so a lone run's durable step is one produce and one
flush, with no thread hand-off. A barrier that finds it taken (another run's barrier, the
waits of an event loop) follows: the writer's serving thread flushes for it and the thread
that serves its last report wakes it. With no one waiting, the serving thread drains the
reports of pipelined appends now and then, and the linger batches them.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any, NamedTuple

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from runlog._settings import Settings
from runlog.errors import KafkaUnavailable
from runlog.log._kafka import with_logger

log = logging.getLogger(__name__)

APPENDS: dict[str, float] = dict.fromkeys(("acknowledged", "failed", "unknown", "ack_seconds"), 0)
"""Process-wide append telemetry (never semantic events): ``acknowledged``, ``failed``
(the broker refused), ``unknown`` (may still be written), and ``ack_seconds`` (their sum,
from produce to acknowledgement). Written by the delivery callback only."""


BARRIERS: dict[str, int] = dict.fromkeys(("served", "followed"), 0)
"""How this process's sync and asyncio barriers got their acknowledgements: ``served``
(the barrier's thread served its own delivery reports and its last one ended the wait),
``followed`` (woken by the thread that served them). Telemetry only."""


class Delivered(NamedTuple):
    """Where the broker wrote an append (a tuple: one is made per acknowledged event)."""

    partition: int
    offset: int
    timestamp_ms: int


class DeliveryFailed(Exception):
    """The broker did not acknowledge an append; ``unknown`` when it may still be written."""

    def __init__(self, error: KafkaError) -> None:
        super().__init__(str(error))
        self.error = error
        # A timeout or a transport error after sending leaves the outcome unknown.
        self.unknown = (
            error.code()
            in (
                KafkaError._MSG_TIMED_OUT,
                KafkaError._TIMED_OUT,
                KafkaError._TRANSPORT,
                KafkaError.REQUEST_TIMED_OUT,
                KafkaError.NOT_ENOUGH_REPLICAS_AFTER_APPEND,
                # Purged after the producer failed fatally: a purged message may have been
                # sent (and written) before, since retries go back to the queue.
                KafkaError._FATAL,
                KafkaError._PURGE_INFLIGHT,
                KafkaError._PURGE_QUEUE,
            )
            or error.retriable()
        )


# Fatal errors that mean "this principal may not write": the producer never got an id, so
# no append was written (an outcome known for sure, unlike other fatal errors).
_REFUSED = frozenset(
    {
        KafkaError.CLUSTER_AUTHORIZATION_FAILED,
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
        KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
    }
)


SERVE_S = 0.1
"""The longest single ``flush`` a serving thread makes before it looks again (under
confluent-kafka's 200 ms chunking, so a callback's exception ends it at once)."""

INLINE_SKIPS = 128
"""The most brief serves skipped after some ran out of their budget (``serve_briefly``)."""

IDLE_S = (0.005, 0.05)
"""How often the serving thread drains delivery reports when no one waits: while appends
are outstanding, and when none are."""


def _forget_frames(exc: BaseException) -> None:
    """Drop the traceback of an exception a ``flush`` raised: it holds the frame that
    flushed and with it the producer, and the exception stays referenced from outside
    Python's collector (the producer's C handle, it appears: a cycle the collector cannot
    break). Every writer's producer outlived its ``close`` that way, its connections
    dialling on (tests/producers/test_writer_release.py)."""
    exc.__traceback__ = None


class _Served(Exception):
    """Raised by the delivery callback that completes a barrier serving its own reports, in
    that barrier's thread: it ends the barrier's ``flush`` at once (librdkafka stops serving
    at a callback's exception, after the batch of reports in hand, whose callbacks all run)."""


REPLACE_INTERVAL_S = 1.0
"""Least time between two replacements of a producer that failed fatally."""

_PURGED = frozenset({KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT})

OWN_WINDOW = 16_384
"""Acknowledged offsets a writer keeps per partition (``EventWriter.own_offsets``), at least;
twice as many before the oldest are dropped (~130 bytes each: a few MB per busy partition)."""
OWN_SPAN = 4096
"""The widest range ``own_offsets`` answers; a wider one is left to the log tail or a read."""


class _OwnOffsets:
    """The key of each record this writer's producer had acknowledged in one partition, by
    offset, in the order the delivery reports came (increasing, per partition)."""

    __slots__ = ("keys", "last")

    def __init__(self) -> None:
        self.keys: dict[int, bytes] = {}
        self.last = -1

    def add(self, offset: int, key: bytes) -> None:
        if offset <= self.last:
            # The log went back (its topic made again): what was kept says nothing of it.
            self.keys.clear()
        self.keys[offset] = key
        self.last = offset
        if len(self.keys) > 2 * OWN_WINDOW:
            for old in list(itertools.islice(self.keys, OWN_WINDOW)):
                del self.keys[old]


def _why_lost(err: KafkaError) -> KafkaError:
    """The error an append lost to the fatal ``err`` fails with."""
    if err.code() in _REFUSED:
        # The broker refused this principal before it got a producer id: nothing of these
        # appends was written, and saying so beats a bare "Purged in queue".
        return err
    return KafkaError(KafkaError._FATAL, f"producer failed fatally: {err}", fatal=True)


def _settle(fut: Future[Delivered], outcome: Delivered | DeliveryFailed) -> None:
    """Resolve ``fut`` once: a purge after a fatal error and a late report may both try."""
    try:
        if isinstance(outcome, Delivered):
            fut.set_result(outcome)
        else:
            fut.set_exception(outcome)
    except InvalidStateError:
        pass  # the first outcome stands (an unknown one, set when the producer was replaced)


Outcome = Delivered | DeliveryFailed
Settle = Callable[[Outcome], None]
"""Receives an append's outcome; may be called twice (a replacement, then a late report):
the first call is the outcome."""


class _Waiter:
    __slots__ = ("left", "wake")

    def __init__(self, left: int, wake: Callable[[], None]) -> None:
        self.left = left
        self.wake = wake


class _Barrier:
    """One sync barrier's wait: woken by whoever serves its last delivery report.

    A barrier that serves itself never sleeps, so it gets no ``threading.Event`` (a
    condition and its lock, ~3 µs): ``sleep`` makes one only when there is something to
    wait for. ``wake`` sets ``done`` before it reads ``event`` and ``sleep`` sets
    ``event`` before it reads ``done``, so one of them always sees the other.
    """

    __slots__ = ("done", "event", "follower", "serving", "thread")

    def __init__(self) -> None:
        self.done = False
        self.event: threading.Event | None = None
        self.thread = threading.get_ident()
        self.serving = False
        """True while this barrier's own thread is in its ``flush``."""
        self.follower: _Follower | None = None

    def wake(self) -> None:
        self.done = True
        event = self.event
        if event is not None:
            event.set()
        if self.serving and threading.get_ident() == self.thread:
            raise _Served
        if self.follower is not None:
            self.follower.leave()

    def sleep(self, timeout: float) -> None:
        """Until woken or ``timeout`` passes."""
        if self.event is None:
            self.event = threading.Event()
        if not self.done:  # its last report may have come meanwhile
            self.event.wait(timeout)


class _Follower:
    """A barrier counted among those the serving thread flushes for, until its last report
    is served (``leave`` from the serving thread), it gives up, or it is cancelled."""

    __slots__ = ("_left", "_writer")

    def __init__(self, writer: EventWriter) -> None:
        self._writer = writer
        self._left = False
        with writer._count:
            writer._followers += 1
        writer._wanted.set()

    def leave(self) -> None:
        """Called once its reports are in (from the thread serving the last one) and when
        it stops waiting; the first call counts. Its waiter must be woken before: when the
        serving thread's flush served the last follower, this ends that flush (``_Served``),
        so that pipelined appends linger again instead of leaving one by one."""
        w = self._writer
        with w._count:
            if self._left:
                return
            self._left = True
            w._followers -= 1
            last = not w._followers
        if last and w._flusher == threading.get_ident():
            raise _Served


class Ack:
    """One append's outcome, filled in by its delivery report (a ``Settle``)."""

    __slots__ = ("_group", "_waiter", "outcome")

    def __init__(self, group: AckGroup) -> None:
        self.outcome: Outcome | None = None
        self._group = group
        self._waiter: _Waiter | None = None

    def __call__(self, outcome: Outcome) -> None:
        self._group._settle(self, outcome)


class AckGroup:
    """The acknowledgements of one run's appends, waited for by the batch.

    A barrier waits for all its appends at once: one wake-up when the last report is in,
    instead of a future (a condition and its lock) per event and a wake-up per report.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def new(self) -> Ack:
        return Ack(self)

    def _settle(self, ack: Ack, outcome: Outcome) -> None:
        with self._lock:
            if ack.outcome is not None:
                return  # the first outcome stands
            ack.outcome = outcome
            waiter, ack._waiter = ack._waiter, None
            if waiter is None:
                return
            waiter.left -= 1
            if waiter.left:
                return
        waiter.wake()

    def watch(self, acks: list[Ack], wake: Callable[[], None]) -> int:
        """How many acks have no outcome yet; if any, ``wake()`` is called once they all
        have (from the thread that delivers the last one). A later call for the same acks
        replaces the earlier waiter (a barrier interrupted and taken up again)."""
        with self._lock:
            left = [a for a in acks if a.outcome is None]
            if left:
                waiter = _Waiter(len(left), wake)
                for a in left:
                    a._waiter = waiter
            return len(left)


def producer_config(settings: Settings, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Durable producer settings: idempotence and acks=all are not librdkafka's defaults.

    A user's tunables (``RUNLOG_KAFKA_EXTRA``) win over runlog's defaults; a setting that
    would break a guarantee is refused naming it (``Settings.durable_producer_config``).
    """
    return settings.durable_producer_config(extra)


class EventWriter:
    """Thread-safe; ``send`` returns a future of ``Delivered``.

    A fatal error of the idempotent producer (librdkafka then refuses every produce for
    the rest of the producer's life) would fail every run in the process until a restart.
    The writer replaces the producer instead: appends still in flight on the old one fail
    with an *unknown* outcome (each run stops and its next ``open_run`` reads the truth
    from the log), and later appends go through the new one.
    """

    def __init__(self, settings: Settings, *, extra: dict[str, Any] | None = None) -> None:
        self.settings = settings
        self._conf = with_logger({**producer_config(settings, extra), "error_cb": self._on_error})
        self._swap = threading.Lock()
        self._fatal: KafkaError | None = None
        self._last_fatal: KafkaError | None = None
        """The latest fatal error, kept after the replacement to explain purged appends."""
        self._replaced_at = float("-inf")
        self._inflight: set[Settle] = set()
        self._producer = Producer(self._conf)
        self._partitions: dict[str, int] = {}
        self._own: dict[tuple[str, int], _OwnOffsets] = {}
        """What this writer's acknowledged records are, per topic and partition."""
        self.replaced = 0
        """How many times a fatal error made the writer replace its producer."""
        self._closed = threading.Event()
        self._serving = threading.Lock()
        """Held by the one thread serving delivery reports: a barrier, or the serving thread."""
        self._count = threading.Lock()
        self._followers = 0
        """Barriers waiting for the serving thread (``_Follower``)."""
        self._wanted = threading.Event()
        """Set when a barrier starts following (or the writer closes)."""
        self._flusher: int | None = None
        """The serving thread's id while it flushes for followers."""
        self._inline_skips = 0
        """Brief serves (``serve_briefly``) still to skip after one ran out of budget."""
        self._inline_misses = 0
        """Brief serves in a row that ran out of budget."""
        self._server = threading.Thread(target=self._serve_loop, name="runlog-writer", daemon=True)
        self._server.start()

    def _on_error(self, err: KafkaError) -> None:
        """librdkafka's error callback (also the entry a test uses to simulate a fatal error)."""
        if err.fatal():
            if self._fatal is None:
                log.error("Kafka producer failed fatally (%s); it will be replaced", err)
            self._fatal = self._last_fatal = err
        else:
            log.warning("Kafka producer error: %s", err)

    def _replace_if_fatal(self) -> None:
        # At most one replacement per REPLACE_INTERVAL_S: a principal the broker refuses
        # fails every new producer at once, and replacing it in a loop would only churn
        # connections; meanwhile its appends fail fast with the refusal.
        if self._fatal is None or time.monotonic() - self._replaced_at < REPLACE_INTERVAL_S:
            return
        with self._swap:
            err = self._fatal
            if err is None:
                return
            old, self._producer = self._producer, Producer(self._conf)
            self._fatal = None
            self._replaced_at = time.monotonic()
            self.replaced += 1
            inflight, self._inflight = self._inflight, set()
        lost = _why_lost(err)
        for settle in inflight:  # before the purge, whose bare reports must not win
            settle(DeliveryFailed(lost))
        try:
            old.purge(in_queue=True, in_flight=True)
            old.flush(0)  # serves the purged messages' delivery reports
        except KafkaException as exc:  # the old producer is dead anyway
            log.warning("purging the failed producer: %s", exc)

    def _serve_loop(self) -> None:
        """Flush while barriers follow; drain the reports of pipelined appends otherwise."""
        while not self._closed.is_set():
            try:
                self._replace_if_fatal()
                if not self._followers:
                    self._wanted.wait(IDLE_S[0] if len(self._producer) else IDLE_S[1])
                    self._wanted.clear()
                if self._followers:
                    self._serve_followers()
                elif self._serving.acquire(blocking=False):
                    try:
                        self._producer.poll(0)
                    finally:
                        self._serving.release()
            except KafkaException as exc:
                self._raised(exc)
            except Exception:  # a callback error must not kill the serving thread
                log.exception("delivery callback failed")

    def _serve_followers(self) -> None:
        """Flush while barriers follow: the flush sends what is queued at once (no lingering
        while someone waits) and serves every report; the last follower's ends it."""
        with self._serving:  # waits while a barrier serves itself (and its followers)
            while self._followers and not self._closed.is_set():
                self._flusher = threading.get_ident()
                try:
                    remaining = self._flush(self._producer, SERVE_S)
                finally:
                    self._flusher = None
                if remaining < 0:
                    # Reports already in (other partitions' batches of the same moment)
                    # are served now, not left for each of their runs to wait for.
                    self._producer.poll(0)
                    continue
                if remaining == 0 and self._followers:
                    # Every report is served, yet someone follows: its appends went to a
                    # replaced producer (settled by the replacement) or it has not left yet.
                    self._wanted.wait(IDLE_S[0])
                    self._wanted.clear()
                    self._replace_if_fatal()

    def _flush(self, producer: Producer, timeout: float) -> int:
        """One ``flush`` serving reports in this thread: how many appends it left
        outstanding, or -1 when a delivery callback ended it (``_Served``). A callback's
        other failure is logged, not raised into whichever barrier happened to serve it."""
        try:
            return int(producer.flush(timeout))
        except _Served as served:
            _forget_frames(served)
            return -1
        except KafkaException as exc:
            _forget_frames(exc)
            self._raised(exc)
        except Exception as exc:
            log.exception("delivery callback failed")
            _forget_frames(exc)
        return len(producer)

    def _raised(self, exc: KafkaException) -> None:
        # librdkafka may raise its fatal error from poll or flush rather than (or as well
        # as) calling error_cb: either way the producer is replaced.
        err = exc.args[0] if exc.args else None
        if isinstance(err, KafkaError) and err.fatal():
            self._on_error(err)
        else:
            log.exception("delivery callback failed")

    def wait(self, group: AckGroup, acks: list[Ack], timeout: float) -> None:
        """Block until every ack has its outcome or ``timeout`` passes (those left without
        one are unknown).

        A lone barrier (its own appends are all the producer has outstanding, and no one
        else serves delivery reports) serves them in this thread: a ``flush`` sends what is
        queued at once and serves the reports here, ended by the callback of this barrier's
        last one: the physical round trip, no hand-off. Otherwise it follows: the serving
        thread flushes, serving every run's reports while their callers do other work (a
        Redis check, the next run's appends), and the thread that serves its last one
        wakes it.
        """
        b = _Barrier()
        own = group.watch(acks, b.wake)
        if not own or self._serve_if_lone(b, own, timeout):
            return
        b.follower = self.follow()
        try:
            b.sleep(timeout)
        finally:
            b.follower.leave()

    def serve_briefly(self, group: AckGroup, acks: list[Ack], budget: float) -> bool:
        """``wait`` for a barrier that may block only briefly (an event loop's): when it is
        a lone barrier, serve its reports in this thread as ``wait`` does, for at most
        ``budget`` seconds. True when every ack has its outcome; False when it is not lone
        or its reports did not come in time (the caller then follows, and its ``watch``
        replaces this one's waiter).

        A broker farther away than the budget would make every such barrier hold its loop
        for the whole budget in vain: after a serve that ran out of it, the next 2, 4, 8...
        (at most ``INLINE_SKIPS``) follow at once, doubling with each miss in a row; one
        served in time starts over (a slow acknowledgement now and then costs a few).
        """
        b = _Barrier()
        own = group.watch(acks, b.wake)
        if not own:
            return True
        if self._inline_skips > 0:
            self._inline_skips -= 1
            return False
        if not self._serve_if_lone(b, own, budget):
            return False
        if b.done:
            self._inline_misses = 0
        else:
            self._inline_misses += 1
            self._inline_skips = min(INLINE_SKIPS, 2**self._inline_misses)
        return b.done

    def _serve_if_lone(self, b: _Barrier, own: int, within: float) -> bool:
        """Serve ``b``'s reports in this thread for at most ``within`` seconds when its
        ``own`` appends are all the producer has outstanding and no one else serves; False
        when it is not lone (it must follow)."""
        if len(self._producer) > own or not self._serving.acquire(blocking=False):
            return False
        try:
            self._serve_until(b, time.monotonic() + within)
        finally:
            self._serving.release()
        return True

    def _serve_until(self, b: _Barrier, deadline: float) -> None:
        """Serve delivery reports in this thread until ``b``'s are in (holding _serving)."""
        while not b.done:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            b.serving = True
            try:
                remaining = self._flush(self._producer, min(left, SERVE_S))
            finally:
                b.serving = False
            if remaining < 0:
                BARRIERS["served"] += 1
                return
            if remaining == 0 and not b.done:
                # Nothing left to serve, yet not woken: its appends went to a producer
                # replaced after a fatal error, whose replacement settles them.
                self._replace_if_fatal()
                b.sleep(min(left, IDLE_S[0]))

    def follow(self) -> _Follower:
        """Count a waiter (an event loop's barrier) among those the serving thread flushes
        for; ``leave()`` when its reports are in or it stops waiting."""
        BARRIERS["followed"] += 1
        return _Follower(self)

    def send(
        self,
        topic: str,
        key: bytes,
        value: bytes,
        headers: list[tuple[str, str | bytes | None]],
        *,
        partition: int | None = None,
    ) -> Future[Delivered]:
        """``submit`` with a future of the outcome (tools and tests)."""
        fut: Future[Delivered] = Future()
        self.submit(topic, key, value, headers, lambda outcome: _settle(fut, outcome), partition)
        return fut

    def submit(
        self,
        topic: str,
        key: bytes,
        value: bytes,
        headers: list[tuple[str, str | bytes | None]],
        settle: Settle,
        partition: int | None = None,
    ) -> None:
        """Produce to ``partition`` and hand the outcome to ``settle`` (from the thread that
        serves delivery reports); None lets the producer hash ``key`` (tools and tests).

        A run's writer always names the run's partition: the producer hashes over the
        partition count in its latest metadata, which after partitions are added is
        another partition than the run's, and a run split over two partitions has no order.
        """
        where: dict[str, Any] = {} if partition is None else {"partition": partition}
        sent = time.monotonic()

        def on_delivery(err: KafkaError | None, msg: Message) -> None:
            self._inflight.discard(settle)
            if err is not None:
                fatal = self._fatal or self._last_fatal
                if err.code() in _PURGED and fatal is not None:
                    # librdkafka purged it because the producer failed: say why.
                    err = _why_lost(fatal)
                failed = DeliveryFailed(err)
                APPENDS["unknown" if failed.unknown else "failed"] += 1
                settle(failed)
            else:
                APPENDS["acknowledged"] += 1
                APPENDS["ack_seconds"] += time.monotonic() - sent
                part, off = msg.partition(), msg.offset()
                assert part is not None and off is not None  # set on every delivered message
                own = self._own.get((topic, part))
                if own is None:
                    own = self._own.setdefault((topic, part), _OwnOffsets())
                own.add(off, key)
                settle(Delivered(part, off, msg.timestamp()[1]))

        fatal_refusals = 0
        while True:
            self._replace_if_fatal()
            try:
                with self._swap:
                    self._inflight.add(settle)
                    self._producer.produce(
                        topic,
                        value=value,
                        key=key,
                        headers=headers,
                        on_delivery=on_delivery,
                        **where,
                    )
                return
            except BufferError:
                self._inflight.discard(settle)
                # Local queue full: let deliveries drain, then try again.
                if self._serving.acquire(timeout=0.05):
                    try:
                        self._producer.poll(0.05)
                    finally:
                        self._serving.release()
            except KafkaException as exc:
                self._inflight.discard(settle)
                error = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
                if error is not None and error.fatal() and fatal_refusals == 0:
                    fatal_refusals += 1
                    self._on_error(error)  # replaced at the top of the loop; never sent
                    continue
                raise KafkaUnavailable(f"produce to {topic} failed: {exc}") from exc

    def own_offsets(
        self, topic: str, partition: int, key: bytes, since: int, upto: int
    ) -> list[int] | None:
        """Offsets in ``[since, upto]`` of records keyed ``key``, when every record there
        is one this writer's producer had acknowledged (so no other writer's stands among
        them); None when it cannot say (a record of another writer, or of none: a control
        record; one not acknowledged yet; a range wider than ``OWN_SPAN``, or forgotten).

        Each offset of a partition holds one record, and the broker acknowledged each of
        these offsets to this producer: the range holds exactly these records, known
        without reading it. An offset whose report is not served yet reads as another
        writer's: the answer is None, never a wrong list."""
        own = self._own.get((topic, partition))
        if own is None or upto - since >= OWN_SPAN or since > upto:
            return None
        keys, found = own.keys, []
        for off in range(since, upto + 1):
            k = keys.get(off)
            if k is None:
                return None
            if k == key:
                found.append(off)
        return found

    def partition_count(self, topic: str) -> int:
        """Partitions of ``topic`` as the broker reported them at this writer's first ask."""
        known = self._partitions.get(topic)
        if known is not None:
            return known
        try:
            md = self._producer.list_topics(topic, timeout=10)
        except KafkaException as exc:
            raise KafkaUnavailable(f"metadata of {topic}: {exc}") from exc
        tmd = md.topics.get(topic)
        if tmd is None or tmd.error is not None or not tmd.partitions:
            raise KafkaUnavailable(f"topic {topic} not found (run `runlog topics create`)")
        self._partitions[topic] = len(tmd.partitions)
        return self._partitions[topic]

    def flush(self, timeout: float = 30.0) -> int:
        """Send everything and serve its reports; the number of appends still outstanding."""
        deadline = time.monotonic() + timeout
        if not self._serving.acquire(timeout=timeout):
            return len(self._producer)
        try:
            return int(self._producer.flush(max(0.0, deadline - time.monotonic())))
        finally:
            self._serving.release()

    def close(self, timeout: float = 30.0) -> None:
        try:
            self.flush(timeout)
        finally:
            self._closed.set()
            self._wanted.set()
            self._server.join(timeout=2)
