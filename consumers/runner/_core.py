"""What every collaborator of the projection runner stands on: its counters, retrying
transient failures (``Retrier``) and the positions and generations it read and wrote
(``PositionStore``, with the one rule of whether a stored position may be written on).
"""

from __future__ import annotations

import enum
import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis
from redis.exceptions import MasterDownError, OutOfMemoryError, ReadOnlyError, TryAgainError

from runlog._settings import Settings
from runlog.consumers._store import Handler
from runlog.errors import KafkaUnavailable, RegistryUnavailable, RunlogError
from runlog.log._clients import REDIS_ERRORS

log = logging.getLogger(__name__)

T = TypeVar("T")

BATCH_SIZE = 500
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


class Retrier:
    """Calls that wait out transient failures: capped exponential backoff, counted in
    ``stats.retries``, given up only when ``stop`` is set (``Stopped``)."""

    def __init__(self, stop: threading.Event, stats: RunnerStats) -> None:
        self.stop = stop
        self.stats = stats

    def retry(self, what: str, fn: Callable[[], T]) -> T:
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
            if self.stop.wait(delay):
                raise Stopped(f"stopped while retrying {what}") from err
            delay = min(delay * 2, BACKOFF_CAP_S)


class Verdict(enum.Enum):
    """What a stored (position, generation) means for this runner's next write."""

    CURRENT = "current"
    """The position this runner read or wrote last, under its generation: write on it."""
    MOVED = "moved"
    """Another writer moved the position forward: this runner's cached states are stale."""
    REGRESSED = "regressed"
    """Below what this runner applied (Redis lost writes, a key deleted): writing on top
    would skip the records in between for good, so refetch from it instead."""
    FENCED = "fenced"
    """A rebuild moved the generation: this runner must not write until it ends."""


class PositionStore:
    """Each projection's position and generation per partition: what Redis holds, and what
    this runner read or wrote last (the stored position may only be at or above it)."""

    def __init__(self, client: redis.Redis, handlers: list[Handler[Any]], retrier: Retrier):
        self.redis = client
        self.handlers = handlers
        self.retrier = retrier
        self._expected: dict[tuple[str, int], int] = {}
        """(projection, partition) -> the position this runner read or wrote last."""
        self._gens: dict[tuple[str, int], int] = {}
        """(projection, partition) -> the generation this runner writes under."""

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

        raws = iter(self.retrier.retry("reading positions", read))
        out: dict[tuple[str, int], tuple[int, int]] = {}
        for p in parts:
            for h in self.handlers:
                pos, gen = next(raws), next(raws)
                out[(h.name, p)] = (
                    int(pos) if pos is not None else -1,
                    int(gen) if gen is not None else 0,
                )
        return out

    def lowest(self, partitions: Iterable[int]) -> dict[int, int]:
        """Lowest stored position over the projections, per partition (-1: none)."""
        parts = sorted(partitions)
        return self._lowest(parts, self.stored(parts))

    def adopt(self, partitions: Iterable[int]) -> dict[int, int]:
        """Read positions and generations, take them as this runner's; lowest each."""
        parts = sorted(partitions)
        got = self.stored(parts)
        for key, (pos, gen) in got.items():
            self._expected[key] = pos
            self._gens[key] = gen
        return self._lowest(parts, got)

    def _lowest(
        self, parts: list[int], got: dict[tuple[str, int], tuple[int, int]]
    ) -> dict[int, int]:
        return {p: min(got[(h.name, p)][0] for h in self.handlers) for p in parts}

    def write_under(self, generations: dict[tuple[str, int], int]) -> None:
        """Write under these generations (a rebuild's, which it fenced live runners with)."""
        self._gens.update(generations)

    def verdict(self, name: str, partition: int, pos: int, gen: int) -> Verdict:
        """Whether this runner may write projection ``name``'s ``partition`` on the stored
        ``pos`` and ``gen``: the one check of the batch commit and of the idle check."""
        me = (name, partition)
        if gen != self._gens.get(me, 0):
            return Verdict.FENCED
        expected = self._expected.get(me, -1)
        if pos < expected:
            return Verdict.REGRESSED
        return Verdict.CURRENT if pos == expected else Verdict.MOVED

    def wrote(self, name: str, partition: int, pos: int) -> None:
        """Projection ``name``'s ``partition`` is at ``pos`` now (written or read so)."""
        self._expected[(name, partition)] = pos
