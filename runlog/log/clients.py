"""Client construction shared by every layer that talks to Redis.

Settings carry the URL, password and TLS options; this is where they become a client, so
a new connection option is honoured by the writer, the services and the CLI alike.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any, cast

import redis
import redis.asyncio as aioredis
import redis.asyncio.cluster
import redis.cluster

from runlog.errors import ConfigError
from runlog.settings import Settings


def redis_client(settings: Settings, **kw: Any) -> redis.Redis:
    opts = _options(settings, kw)
    if settings.redis_cluster:
        # A RedisCluster answers the same commands (every multi-key command runlog sends
        # names keys of one hash slot); typed as redis.Redis for the callers.
        return cast(redis.Redis, redis.cluster.RedisCluster.from_url(settings.redis_url, **opts))
    client: redis.Redis = redis.Redis.from_url(settings.redis_url, **opts)
    return client


class ThreadGet:
    """``GET`` over a connection of the calling thread's own, for a hot path's one key.

    redis-py's command path (a pool checkout and return, the retry wrapper, telemetry
    hooks) costs about as much CPU as the round trip itself; a barrier asks once per
    durable step. A dropped connection is retried once on a fresh one, as the client's
    own retry would. A cluster client routes by key: it keeps its own ``get``.
    """

    def __init__(self, client: redis.Redis) -> None:
        self._client = client
        self._local = threading.local()
        self._lock = threading.Lock()
        # Weak: a thread's connection closes with the thread (redis-py disconnects on
        # collection); close() ends those of threads still alive.
        self._conns: weakref.WeakSet[redis.connection.ConnectionInterface] = weakref.WeakSet()
        self._direct = type(client) is redis.Redis
        self._packed: dict[str, Any] = {}
        """``GET key`` as the wire carries it, per key: a run asks for the same key at
        every barrier, and packing it anew is a good part of redis-py's cost."""

    def __call__(self, key: str) -> Any:
        if not self._direct:
            return self._client.get(key)
        conn = self._conn()
        packed = self._packed.get(key)
        if packed is None:
            if len(self._packed) >= PACKED_KEPT:
                self._packed.clear()
            packed = self._packed[key] = [b"".join(conn.pack_command("GET", key))]
        try:
            return self._get(conn, packed)
        except (redis.ConnectionError, redis.TimeoutError):
            return self._get(conn, packed)  # connects anew

    def _conn(self) -> Any:
        """This thread's connection (redis-py's connection API is untyped)."""
        held = getattr(self._local, "held", None)
        if held is not None and held[0] == os.getpid():
            return held[1]
        # New, or inherited through a fork: the parent's socket is the parent's.
        # Outside the pool's count: its limit is for the client's own checkouts.
        pool = self._client.connection_pool
        conn = pool.connection_class(**pool.connection_kwargs)
        self._local.held = (os.getpid(), conn)
        with self._lock:
            self._conns.add(conn)
        return conn

    @staticmethod
    def _get(conn: Any, packed: Any) -> Any:
        try:
            conn.send_packed_command(packed)
            return conn.read_response()
        except BaseException:
            # Whatever stopped the exchange (a dropped connection, a timeout, ^C) may
            # leave a reply unread, which the next GET would take for its own.
            conn.disconnect()
            raise

    def close(self) -> None:
        with self._lock:
            conns, self._conns = list(self._conns), weakref.WeakSet()
        for conn in conns:
            conn.disconnect()  # type: ignore[no-untyped-call]


PACKED_KEPT = 4096
"""Keys whose packed ``GET`` a ``ThreadGet`` keeps (all are dropped when it is full)."""


def async_redis_client(settings: Settings, **kw: Any) -> aioredis.Redis:
    """The asyncio client with the same connection options (bound to one event loop).

    Its pool blocks for a free connection instead of failing: hundreds of runs in one
    loop share ``ASYNC_CONNECTIONS`` connections, each used for one GET at a time.
    With ``RUNLOG_REDIS_CLUSTER`` it is the asyncio cluster client (its own pools per node).
    """
    if settings.redis_cluster:
        cluster = redis.asyncio.cluster.RedisCluster.from_url(
            settings.redis_url, **_options(settings, kw)
        )
        return cast(aioredis.Redis, cluster)
    pool = aioredis.BlockingConnectionPool.from_url(
        settings.redis_url, max_connections=ASYNC_CONNECTIONS, timeout=10, **_options(settings, kw)
    )
    return aioredis.Redis(connection_pool=pool)


ASYNC_CONNECTIONS = 32


def _options(settings: Settings, kw: dict[str, Any]) -> dict[str, Any]:
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
    return opts
