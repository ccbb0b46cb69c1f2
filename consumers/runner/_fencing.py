"""Rebuild fencing: the markers a rebuild sets and renews, and the runner's fence, which
reads them (may this runner write?) and completes a rebuild that died (``rebuild``).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis

from runlog.consumers._store import Handler
from runlog.consumers.runner._batch import Retrier
from runlog.consumers.runner._core import Stopped
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


class RebuildFence:
    """The runner's side of a rebuild: whether one holds its projections (its marker, or
    the incomplete marker of one that died), and completing one that died.

    It reads markers and starts the completion; pausing and resuming the consumer is the
    loop's, and so is the refold itself (``refold``: a takeover ``rebuild`` of the names).
    """

    def __init__(
        self,
        client: redis.Redis,
        handlers: list[Handler[Any]],
        retrier: Retrier,
        refold: Callable[[list[str]], None],
    ) -> None:
        self.redis = client
        self.handlers = handlers
        self.retrier = retrier
        self.refold = refold
        self._finisher: threading.Thread | None = None
        """Completing a rebuild that died (``over``), beside the paused consumer."""
        self._finish_after = 0.0

    def status(self) -> tuple[bool, list[str]]:
        """(a rebuild's marker is present, the projections a dead rebuild left incomplete)."""
        running = [h.keys.rebuild_marker() for h in self.handlers]
        left = [h.keys.incomplete_marker() for h in self.handlers]

        def read() -> list[int]:
            # One EXISTS per marker: the markers of several projections share no slot.
            with self.redis.pipeline(transaction=False) as pipe:
                for key in running + left:
                    pipe.exists(key)
                return [int(n) for n in pipe.execute()]

        found = self.retrier.retry("reading rebuild markers", read)
        names = [h.name for h, n in zip(self.handlers, found[len(running) :], strict=True) if n]
        return any(found[: len(running)]), names

    def blocks(self) -> bool:
        running, left = self.status()
        return running or bool(left)

    def over(self) -> bool:
        """Asked while paused for a rebuild: True once it is over and complete (resume).

        A rebuild that died leaves its incomplete marker (``rebuild``): once its own marker
        has expired, this runner refolds those projections from zero (in a thread, so the
        paused consumer keeps its group membership), unless another rebuild took them.
        """
        if self._finisher is not None:
            if self._finisher.is_alive():
                return False
            self._finisher = None
        running, left = self.status()
        if running:
            return False
        if not left:
            return True
        if time.monotonic() < self._finish_after:
            return False
        self._finish_after = time.monotonic() + TAKEOVER_RETRY_S
        log.warning(
            "a rebuild of %s died before it finished: completing it from offset zero",
            "+".join(left),
        )
        self._finisher = threading.Thread(
            target=self._finish_rebuild, args=(left,), name="runlog-finish-rebuild", daemon=True
        )
        self._finisher.start()
        return False

    def _finish_rebuild(self, names: list[str]) -> None:
        try:
            self.refold(names)
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

    def join(self, timeout: float) -> None:
        """Wait for a completion in progress (it sees the runner's stop; what it had not
        refolded stays marked incomplete)."""
        if self._finisher is not None:
            self._finisher.join(timeout=timeout)
