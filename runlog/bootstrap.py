"""The composition root: the one place that creates Kafka and Redis clients.

Nothing connects at import time. ``Services.shared(settings)`` gives one set of clients
per process and settings, so many runs share one producer and one Redis pool.
"""

from __future__ import annotations

import os
import socket
import threading
from typing import Any, ClassVar

import redis

from runlog.errors import ConfigError
from runlog.settings import Settings


def redis_client(settings: Settings, **kw: Any) -> redis.Redis:
    password = settings.redis_password.get_secret_value() if settings.redis_password else None
    opts: dict[str, Any] = {"socket_timeout": 5.0, "socket_connect_timeout": 3.0}
    if password is not None:
        opts["password"] = password
    if settings.redis_username:
        opts["username"] = settings.redis_username
    if settings.redis_ssl_ca:
        # A CA only means something over TLS; on a redis:// URL redis-py would fail later
        # with a TypeError, far from the setting that caused it.
        if not settings.redis_url.startswith("rediss://"):
            raise ConfigError(
                "RUNLOG_REDIS_SSL_CA is set but RUNLOG_REDIS_URL is not a rediss:// (TLS) URL"
            )
        opts["ssl_ca_certs"] = settings.redis_ssl_ca
    opts.update(kw)
    client: redis.Redis = redis.Redis.from_url(settings.redis_url, **opts)
    return client


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
        self._writer: Any = None
        self._leases: Any = None
        self._snapshots: Any = None

    @classmethod
    def shared(cls, settings: Settings) -> Services:
        key = settings.model_dump_json()
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
    def writer(self) -> Any:
        from runlog.producers.writer import EventWriter

        with self._lock:
            if self._writer is None:
                self._writer = EventWriter(self.settings)
            return self._writer

    @property
    def leases(self) -> Any:
        from runlog.producers.lease import LeaseManager

        client = self.redis
        with self._lock:
            if self._leases is None:
                self._leases = LeaseManager(client, key_prefix=self.settings.redis_key_prefix)
            return self._leases

    @property
    def snapshots(self) -> Any:
        """The snapshot store, when snapshots are enabled in the settings."""
        if self.settings.snapshot_interval <= 0:
            return None
        try:
            from runlog.consumers.snapshots import SnapshotStore  # type: ignore[import-not-found,unused-ignore]
        except ImportError:  # pragma: no cover - snapshots not shipped in this build
            return None
        client = self.redis
        with self._lock:
            if self._snapshots is None:
                self._snapshots = SnapshotStore(client, self.settings)
            return self._snapshots

    def run_deps(self) -> Any:
        from runlog.log.reader import LogReader
        from runlog.producers.run import RunDeps

        return RunDeps(
            settings=self.settings,
            writer=self.writer,
            leases=self.leases,
            redis=self.redis,
            reader_factory=lambda: LogReader(self.settings),
            writer_id=self.writer_id,
            snapshots=self.snapshots,
        )

    def close(self) -> None:
        with self._lock:
            if self._writer is not None:
                self._writer.close()
                self._writer = None
            if self._leases is not None:
                self._leases.close()
                self._leases = None
            if self._redis is not None:
                self._redis.close()
                self._redis = None
