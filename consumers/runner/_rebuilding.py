"""Rebuild a projection from offset zero while live runners are fenced, not raced."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import redis

from runlog._settings import Settings
from runlog.consumers.runner._fencing import RebuildMarker, delete_if_ours
from runlog.consumers.stores import make_handler
from runlog.errors import RedisUnavailable
from runlog.log._authority import authority_for
from runlog.log._clients import REDIS_ERRORS


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


class Refolder(Protocol):
    """A runner that folds projections from zero (``ProjectionRunner``)."""

    def catch_up(
        self,
        *,
        progress: Callable[[int, int], None] | None = ...,
        generations: dict[tuple[str, int], int] | None = ...,
    ) -> dict[int, int]: ...


def rebuild_with(
    new_runner: Callable[[], Refolder],
    client: redis.Redis,
    settings: Settings,
    names: Sequence[str],
    *,
    progress: Callable[[int, int], None] | None = None,
    takeover: bool = False,
) -> dict[int, int]:
    """Delete the projections and fold the log from offset zero up to today's watermarks,
    with the runner ``new_runner`` makes (``runner.rebuild``: a ``ProjectionRunner``, which
    stops with the rebuild's caller).

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
        with RebuildMarker(
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
            runner = new_runner()
            targets = runner.catch_up(progress=progress, generations=generations)
            # Complete: only now may runners trust and write the projection again. Only
            # our own mark: one set by a rebuild that started since is that one's to clear.
            for h in handlers:
                delete_if_ours(client, h.keys.incomplete_marker(), marker.value)
            return targets
    except REDIS_ERRORS as exc:
        raise RedisUnavailable(f"rebuilding {', '.join(names)}: {exc}") from exc
