"""What every part of the projection runner names: its counters (``RunnerStats``), its
batch size and backoff, which Redis failures are transient, and ``Stopped``.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import redis
from redis.exceptions import MasterDownError, OutOfMemoryError, ReadOnlyError, TryAgainError

from runlog._settings import Settings
from runlog.errors import RunlogError

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
