"""Rebuild fencing: the markers a rebuild sets and renews, and how a live runner pauses
for a rebuild, resumes after it, or completes one that died (``rebuild``).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any

import redis
from confluent_kafka import TopicPartition

from runlog.consumers.runner._core import RunnerBase, Stopped
from runlog.errors import RunlogError
from runlog.log._clients import REDIS_ERRORS

log = logging.getLogger(__name__)

REBUILD_MARKER_TTL_S = 30
"""Lifetime of a rebuild's marker unless renewed: a crashed rebuild frees live runners."""
TAKEOVER_RETRY_S = 5.0
"""A runner's attempt to complete a dead rebuild failed: when it tries again."""


class ProjectionRebuilt(RunlogError):
    """Another rebuild moved a projection's generation while this catch-up was writing it."""


class RebuildBusy(RunlogError):
    """Another process is rebuilding the projection (a runner's takeover stands aside)."""


class RebuildIncomplete(RunlogError):
    """A rebuild of the projection died before it finished: rebuild it (or start a runner)."""


def _ours(raw: Any, value: str) -> bool:
    return (raw.decode() if isinstance(raw, bytes) else raw) == value


def delete_if_ours(client: redis.Redis, key: str, value: str) -> None:
    """Delete a marker only if it still holds this rebuild's value.

    WATCH and MULTI, not a script: projection services may not run scripts (their Redis
    ACL, ``runlog._security``), and they complete dead rebuilds. One key: any slot.
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


class RebuildMarker:
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
                    delete_if_ours(self.client, k, self.value)
                raise RebuildBusy(f"another rebuild holds {key}")
            taken.append(key)

    def _renew(self) -> None:
        while not self._done.wait(REBUILD_MARKER_TTL_S / 6):
            try:
                for key in self.keys:
                    _renew_if_ours(self.client, key, self.value)
            except REDIS_ERRORS as exc:  # the next renewal may pass; the TTL is long
                log.warning("renewing the rebuild marker failed: %s", exc)

    def __enter__(self) -> RebuildMarker:
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
            delete_if_ours(self.client, key, self.value)


class FencedRunner(RunnerBase):
    """The runner's side of a rebuild: wait while one runs, finish one that died."""

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

    def _refold(self, names: list[str]) -> None:
        """Rebuild ``names`` from zero as a takeover (``rebuild``): the runner that folds
        them is the concrete runner's to make, so this layer does not name it."""
        raise NotImplementedError

    def _finish_rebuild(self, names: list[str]) -> None:
        try:
            self._refold(names)
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
