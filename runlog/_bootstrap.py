"""The composition root: the one place that wires clients into the writer and services.

Nothing connects at import time. ``Services.shared(settings)`` gives one set of clients
per process and settings, so many runs share one producer and one Redis pool.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable
from typing import ClassVar, Generic, TypeVar

import redis

from runlog._settings import Settings
from runlog.fleet._lifecycle import close_writers
from runlog.log._clients import redis_client
from runlog.log._keys import KeyStore, keys_for
from runlog.log._keys import close_shared as close_keys
from runlog.log._reader import ReaderPool
from runlog.log._registry import ids_for
from runlog.log._snapshots import SnapshotStore
from runlog.log._tail import LogTail
from runlog.producers._engine import RunDeps
from runlog.producers._lease import LeaseManager
from runlog.producers._writer import EventWriter


def default_writer_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


T = TypeVar("T")


class _Once(Generic[T]):
    """One client, made on first use (once, whatever the threads) and closed on demand."""

    def __init__(self, make: Callable[[], T]) -> None:
        self._make = make
        self._lock = threading.Lock()
        self._value: T | None = None

    def get(self) -> T:
        with self._lock:
            if self._value is None:
                self._value = self._make()
            return self._value

    def close(self, close: Callable[[T], object]) -> None:
        """``close`` the client if one was made; the next ``get`` makes a new one."""
        with self._lock:
            if self._value is not None:
                close(self._value)
                self._value = None


class Services:
    """Clients and services for one ``Settings``; created lazily, closed together."""

    _shared: ClassVar[dict[str, Services]] = {}
    _shared_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, settings: Settings, *, writer_id: str | None = None) -> None:
        self.settings = settings
        self.writer_id = writer_id or default_writer_id()
        self._redis = _Once(lambda: redis_client(settings))
        self._writer = _Once(lambda: EventWriter(settings))
        self._leases = _Once(self._lease_manager)
        self._snapshots = _Once(lambda: SnapshotStore(self.redis, settings))
        self._tail = _Once(lambda: LogTail(settings))
        self._readers = _Once(lambda: ReaderPool(settings))

    def _lease_manager(self) -> LeaseManager:
        s = self.settings
        liveness = min(s.liveness_ttl_ms, s.lease_ttl_ms) if s.liveness_ttl_ms else 0
        return LeaseManager(
            self.redis,
            key_prefix=s.redis_key_prefix,
            liveness_ttl_ms=liveness,
            info=f"{self.writer_id}|{socket.gethostname()}|{os.getpid()}",
        )

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

    @classmethod
    def close_shared(
        cls, bootstrap_servers: str | None = None, *, redis_url: str | None = None
    ) -> None:
        """Close the process's shared services: all, or those whose settings name
        ``bootstrap_servers`` or ``redis_url`` (before that cluster or Redis goes away, so
        no client, and no lease renewal, is left retrying it)."""
        with cls._shared_lock:
            keys = [
                k
                for k, svc in cls._shared.items()
                if bootstrap_servers in (None, svc.settings.bootstrap_servers)
                and redis_url in (None, svc.settings.redis_url)
            ]
            closing = [cls._shared.pop(k) for k in keys]
        for svc in closing:
            svc.close()
        if redis_url is None:  # the key stores and lifecycle writers hold Kafka clients only
            close_keys(bootstrap_servers)
            close_writers(bootstrap_servers)

    @property
    def redis(self) -> redis.Redis:
        return self._redis.get()

    @property
    def writer(self) -> EventWriter:
        return self._writer.get()

    @property
    def leases(self) -> LeaseManager:
        return self._leases.get()

    @property
    def snapshots(self) -> SnapshotStore | None:
        """The snapshot store, when snapshots are enabled in the settings."""
        if self.settings.snapshot_interval <= 0:
            return None
        return self._snapshots.get()

    @property
    def keys(self) -> KeyStore | None:
        """The data keys of sealed content (``runlog.log._keys``): what readers open with,
        writers seal with and ``shred`` destroys; None without a KEK (encryption off)."""
        return keys_for(self.settings)

    @property
    def tail(self) -> LogTail:
        return self._tail.get()

    def run_deps(self) -> RunDeps:
        return RunDeps(
            settings=self.settings,
            writer=self.writer,
            leases=self.leases,
            redis=self.redis,
            reader_factory=self._readers.get().get,
            writer_id=self.writer_id,
            snapshots=self.snapshots,
            ids=ids_for(self.settings),
            tail=self.tail,
        )

    def close(self) -> None:
        self._writer.close(EventWriter.close)
        self._leases.close(LeaseManager.close)
        self._tail.close(LogTail.close)
        self._readers.close(ReaderPool.close)
        self._redis.close(redis.Redis.close)
