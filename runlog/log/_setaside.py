"""Records an operator set aside: readers skip them instead of refusing the run.

A record of a run that cannot be decoded stops every reader of that run: a writer must not
act on a log it cannot read. When a person decides the record carries nothing the run
needs (a stray write under the run's key, bytes from a broken producer), they set it aside
with ``runlog records set-aside``; every reader of runs (the writer, replay, verify and
snapshots, all through ``LogReader``) then skips exactly that record, so they all still
fold the same events. The decision is kept in Redis with who, when and why; if Redis loses
it, readers refuse the run again until it is recorded again: safe, never a different fold.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import redis

from runlog._settings import Settings
from runlog.errors import RedisUnavailable
from runlog.log._clients import REDIS_ERRORS


def set_aside_key(settings: Settings) -> str:
    return f"{settings.redis_key_prefix}:setaside:{settings.events_topic}"


def set_aside_offsets(client: redis.Redis, settings: Settings, partition: int) -> frozenset[int]:
    """Offsets set aside in ``partition`` of the events topic."""
    try:
        fields = client.hkeys(set_aside_key(settings))
    except REDIS_ERRORS as exc:
        raise RedisUnavailable(f"set-aside records of {settings.events_topic}: {exc}") from exc
    out: set[int] = set()
    for raw in fields:
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        part, _, off = text.partition(":")
        if part == str(partition):
            out.add(int(off))
    return frozenset(out)


def set_aside(
    client: redis.Redis,
    settings: Settings,
    partition: int,
    offset: int,
    *,
    by: str,
    reason: str,
    error: str,
) -> bool:
    """Record the decision; False if that record was already set aside (first one stands)."""
    entry = {
        "by": by,
        "reason": reason,
        "error": error,
        "at": datetime.now(UTC).isoformat(),
    }
    try:
        return bool(
            client.hsetnx(set_aside_key(settings), f"{partition}:{offset}", json.dumps(entry))
        )
    except REDIS_ERRORS as exc:
        raise RedisUnavailable(f"setting aside {partition}:{offset}: {exc}") from exc


def list_set_aside(client: redis.Redis, settings: Settings) -> list[dict[str, Any]]:
    try:
        raw = client.hgetall(set_aside_key(settings))
    except REDIS_ERRORS as exc:
        raise RedisUnavailable(f"set-aside records of {settings.events_topic}: {exc}") from exc
    out: list[dict[str, Any]] = []
    for k, v in raw.items():
        where = k.decode() if isinstance(k, bytes) else str(k)
        part, _, off = where.partition(":")
        out.append({"partition": int(part), "offset": int(off), **json.loads(v)})
    return sorted(out, key=lambda e: (e["partition"], e["offset"]))
