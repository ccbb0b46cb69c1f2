"""The composition root: the one place that wires clients into the writer and services.

Nothing connects at import time. ``Services.shared(settings)`` gives one set of clients
per process and settings, so many runs share one producer and one Redis pool.
"""

from __future__ import annotations

import os
import socket
import threading
from typing import ClassVar

import redis

from runlog.consumers.snapshots import SnapshotStore
from runlog.log.clients import redis_client
from runlog.log.reader import LogReader
from runlog.log.registry import ids_for
from runlog.log.tail import LogTail
from runlog.producers.lease import LeaseManager
from runlog.producers.run import RunDeps
from runlog.producers.writer import EventWriter
from runlog.settings import Settings


def default_writer_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class Services:
    """Clients and services for one ``Settings``; created lazily, closed together."""

    _shared: ClassVar[dict[str, Services]] = {}
    _shared_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, settings: Settings, *, writer_id: str | None = None) -> None:
        self.settings = settings
        self.writer_id = writer_id or default_writer_id()
        self._lock = threading.Lock()
        self._redis: redis.Redis | None = None
        self._writer: EventWriter | None = None
        self._leases: LeaseManager | None = None
        self._snapshots: SnapshotStore | None = None
        self._tail: LogTail | None = None

    @classmethod
    def shared(cls, settings: Settings) -> Services:
        # Not model_dump_json(): secrets dump masked, so settings that differ only in a
        # secret (a password, a RUNLOG_KAFKA_EXTRA value) would share one client.
        key = settings.fingerprint()
        with cls._shared_lock:
            svc = cls._shared.get(key)
            if svc is None or svc.writer_id != default_writer_id():  # forked: new clients
                svc = cls._shared[key] = Services(settings)
            return svc

    @property
    def redis(self) -> redis.Redis:
        with self._lock:
            if self._redis is None:
                self._redis = redis_client(self.settings)
            return self._redis

    @property
    def writer(self) -> EventWriter:
        with self._lock:
            if self._writer is None:
                self._writer = EventWriter(self.settings)
            return self._writer

    @property
    def leases(self) -> LeaseManager:
        client = self.redis
        with self._lock:
            if self._leases is None:
                self._leases = LeaseManager(client, key_prefix=self.settings.redis_key_prefix)
            return self._leases

    @property
    def snapshots(self) -> SnapshotStore | None:
        """The snapshot store, when snapshots are enabled in the settings."""
        if self.settings.snapshot_interval <= 0:
            return None
        client = self.redis
        with self._lock:
            if self._snapshots is None:
                self._snapshots = SnapshotStore(client, self.settings)
            return self._snapshots

    @property
    def tail(self) -> LogTail:
        with self._lock:
            if self._tail is None:
                self._tail = LogTail(self.settings)
            return self._tail

    def run_deps(self) -> RunDeps:
        return RunDeps(
            settings=self.settings,
            writer=self.writer,
            leases=self.leases,
            redis=self.redis,
            reader_factory=lambda: LogReader(self.settings),
            writer_id=self.writer_id,
            snapshots=self.snapshots,
            ids=ids_for(self.settings),
            tail=self.tail,
        )

    def close(self) -> None:
        with self._lock:
            if self._writer is not None:
                self._writer.close()
                self._writer = None
            if self._leases is not None:
                self._leases.close()
                self._leases = None
            if self._tail is not None:
                self._tail.close()
                self._tail = None
            if self._redis is not None:
                self._redis.close()
                self._redis = None
