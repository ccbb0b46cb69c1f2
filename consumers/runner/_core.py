"""What every part of the projection runner stands on: its settings, clients and
projections' handlers, the positions it read and wrote, and retrying transient failures.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis
from confluent_kafka import OFFSET_BEGINNING, KafkaException, TopicPartition
from redis.exceptions import MasterDownError, OutOfMemoryError, ReadOnlyError, TryAgainError

from runlog._settings import Settings
from runlog.consumers._notify import Hook, Notifier
from runlog.consumers._store import Handler
from runlog.consumers.stores import NOTIFY, make_handler
from runlog.errors import KafkaUnavailable, NoKeys, RegistryUnavailable, RunlogError
from runlog.log._authority import authority_for
from runlog.log._clients import REDIS_ERRORS
from runlog.log._keys import KeyStore, keys_for
from runlog.log._registry import ids_for

log = logging.getLogger(__name__)


def _keys_or_none(settings: Settings) -> KeyStore | None:
    """The runner's key store, or None: a runner without keys folds a sealed record's
    structure with its content erased and marks the run ``sealed: no key`` (it never stops
    on one: every other run of its partitions would stop with it). Said at start when
    encryption is on, where every new record is sealed."""
    try:
        store = keys_for(settings)
    except NoKeys as exc:
        log.warning(
            "encryption is on but this projection service has no key store (%s): sealed "
            "records are folded with their content erased and their runs marked "
            "'sealed: no key' (runlog project status counts them)",
            exc,
        )
        return None
    if store is None:
        log.info(
            "no key store (RUNLOG_KEK unset): a sealed record is folded with its content "
            "erased and its run marked 'sealed: no key'"
        )
    return store


T = TypeVar("T")

BATCH_SIZE = 500
CATCH_UP_BATCH = 5000
BACKOFF_START_S = 0.05
BACKOFF_CAP_S = 5.0

_TRANSIENT_REDIS = (redis.ConnectionError, redis.TimeoutError)
# Replies of a Redis that is up but cannot take this write now. redis-py maps some codes
# to classes (stripping the code from the message) and leaves others as ResponseError.
_TRANSIENT_REPLY_CLASSES = (ReadOnlyError, OutOfMemoryError, TryAgainError, MasterDownError)
_TRANSIENT_REPLY_CODES = frozenset({"BUSY", "READONLY", "OOM", "LOADING", "MASTERDOWN", "TRYAGAIN"})


def transient_redis_error(exc: BaseException) -> bool:
    """True for a Redis failure that passes on its own: retry later, never skip or crash."""
    if isinstance(exc, _TRANSIENT_REDIS + _TRANSIENT_REPLY_CLASSES):
        return True
    if not isinstance(exc, redis.ResponseError):
        return False
    # In a pipeline redis-py prefixes "Command # n (...) of pipeline caused error: ".
    reply = str(exc).rsplit("caused error: ", 1)[-1]
    return reply.split(" ", 1)[0] in _TRANSIENT_REPLY_CODES


class Stopped(RunlogError):
    """The runner was asked to stop while waiting to retry."""


def default_group(settings: Settings, projections: Sequence[str]) -> str:
    return f"{settings.topic_prefix}.projection.{'+'.join(projections)}"


@dataclass
class RunnerStats:
    """In-process counters (the durable ones are in Redis, see ``consumers._store``)."""

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


class RunnerBase:
    """A runner's state and the positions it owns (``ProjectionRunner`` is the whole)."""

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
        each notification the notify projection queues (``consumers._notify``)."""
        if not projections:
            raise ValueError("at least one projection")
        if notify is not None and NOTIFY not in projections:
            raise ValueError(f"a notification hook needs the {NOTIFY!r} projection")
        self.settings = settings
        self.topic = settings.events_topic
        self._ids = ids_for(settings)
        self._keys = _keys_or_none(settings)
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

    # Control ----------------------------------------------------------------------
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
            except REDIS_ERRORS as exc:
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

    # Positions --------------------------------------------------------------------
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
