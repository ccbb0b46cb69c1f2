"""Client construction shared by every layer that talks to Redis.

Settings carry the URL, password and TLS options; this is where they become a client, so
a new connection option is honoured by the writer, the services and the CLI alike.
"""

from __future__ import annotations

import asyncio
import collections
import os
import threading
import weakref
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, cast

import hiredis
import redis
import redis.asyncio as aioredis
import redis.asyncio.cluster
import redis.cluster
from redis._parsers import BaseParser

from runlog._settings import Settings
from runlog.errors import ConfigError

REDIS_ERRORS: tuple[type[Exception], ...] = (
    redis.RedisError,
    redis.exceptions.RedisClusterException,
)
"""What a Redis call may raise when Redis fails. A cluster client that reaches no node
raises ``RedisClusterUnreachableError``, which is not a ``RedisError``: a handler that
caught only the latter let a cluster outage end the thread it ran in."""


def redis_client(settings: Settings, **kw: Any) -> redis.Redis:
    opts = _options(settings, kw)
    if settings.redis_cluster:
        # A RedisCluster answers the same commands (every multi-key command runlog sends
        # names keys of one hash slot); typed as redis.Redis for the callers.
        return cast(redis.Redis, redis.cluster.RedisCluster.from_url(settings.redis_url, **opts))
    # redis-py's default pool holds 100 connections and refuses the 101st ("Too many
    # connections"): 500 threads opening runs at once on one process's client made 358 of
    # them fail with RedisUnavailable. This pool makes a thread wait for a connection.
    pool = redis.BlockingConnectionPool.from_url(
        settings.redis_url, max_connections=SYNC_CONNECTIONS, timeout=SYNC_POOL_WAIT_S, **opts
    )
    return redis.Redis(connection_pool=pool)


SYNC_CONNECTIONS = 100
"""Connections of one synchronous client (redis-py's own default); a thread beyond them
waits for one to come back instead of failing."""
SYNC_POOL_WAIT_S = 30.0
"""How long a thread waits for a free connection before ``ConnectionError``."""


def own_pool(client: redis.Redis) -> redis.Redis:
    """A client of ``client``'s Redis on a connection pool of its own, for one thread that
    must never wait behind the process's pool: the lease renewer. With every connection of
    the shared pool out (a burst of hundreds of opens), a renewal that waited for one could
    let the process's liveness key expire, and every lease bound to it with it. A cluster
    client (a pool per node, routed by key) is returned as it is."""
    if not isinstance(client, redis.Redis):
        return client
    pool = client.connection_pool
    own = redis.ConnectionPool(connection_class=pool.connection_class, **pool.connection_kwargs)
    return redis.Redis(connection_pool=own)


OWN_AFTER = 8
"""Asks a thread makes through the client's pool before ``ThreadGet`` gives it a
connection of its own (a writer's thread asks at every durable step: it soon has one)."""


class ThreadGet:
    """``GET`` over a connection of the calling thread's own, for a hot path's one key.

    redis-py's command path (a pool checkout and return, the retry wrapper, telemetry
    hooks) costs about as much CPU as the round trip itself; a barrier asks once per
    durable step. A dropped connection is retried once on a fresh one, as the client's
    own retry would. A cluster client routes by key: it keeps its own ``get``.
    """

    def __init__(self, client: redis.Redis, *, own_after: int = OWN_AFTER) -> None:
        """``own_after``: asks a thread makes over the client's pool before it gets a
        connection of its own (0: at once)."""
        self._client = client
        self._own_after = own_after
        self._local = threading.local()
        self._lock = threading.Lock()
        # Weak: a thread's connection closes with the thread (redis-py disconnects on
        # collection); close() ends those of threads still alive.
        self._conns: weakref.WeakSet[redis.connection.ConnectionInterface] = weakref.WeakSet()
        self._direct = type(client) is redis.Redis
        self._packed: dict[str | tuple[str, ...], Any] = {}
        """``GET key`` (``MGET keys``) as the wire carries it, per key: a run asks for the
        same key at every barrier, and packing it anew is a good part of redis-py's cost."""

    def __call__(self, key: str) -> Any:
        if not self._direct or not self._own():
            return self._client.get(key)
        return self._ask(key, ("GET", key))

    def many(self, keys: tuple[str, ...]) -> list[Any]:
        """``MGET keys`` in the same one round trip (keys of one hash slot: one run's)."""
        if not self._direct or not self._own():
            return list(self._client.mget(list(keys)))
        return list(self._ask(keys, ("MGET", *keys)))

    def _own(self) -> bool:
        """Whether this thread asks over a connection of its own: once it has asked
        ``own_after`` times. A thread that asks a few times (a run opened and closed from
        a thread of its own: three asks) borrows a pooled connection instead: connecting
        and the handshake cost more than the GETs, and 500 such threads at once made 500
        connections."""
        local = self._local
        if getattr(local, "held", None) is not None:
            return True
        asked = getattr(local, "asked", 0)
        if asked >= self._own_after:
            return True
        local.asked = asked + 1
        return False

    def _ask(self, cache: str | tuple[str, ...], command: tuple[str, ...]) -> Any:
        conn = self._conn()
        packed = self._packed.get(cache)
        if packed is None:
            if len(self._packed) >= PACKED_KEPT:
                self._packed.clear()
            packed = self._packed[cache] = [b"".join(conn.pack_command(*command))]
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


class LoopGet:
    """``GET`` for an event loop's hot path, pipelined over one connection of its own.

    redis.asyncio's command path (a pool checkout and return under a lock, a task per send
    under ``socket_timeout``, the stream parser's awaits) costs 100-150 us of CPU per
    ``GET``, and the asyncio barrier asks once per durable step. This opens its connection
    through the client's own connection class, so TLS, AUTH and SELECT are done exactly as
    the client does them, then takes the transport over: a command is written and its
    reply is matched by order (Redis answers one connection's commands in order), so the
    runs of one loop share the connection without waiting for each other's replies.

    Group commit: what the loop's runs ask for in one tick (the ownership checks of every
    barrier whose acknowledgements came in together, their steps' cancel checks) is read
    in one ``MGET`` written at the next tick, one command and one reply for all of them,
    each run comparing its own lease token (``AsyncRun``): a fenced run among them is
    refused, the others go on. A lone key is one ``GET``.

    One per asyncio client (``loop_get``), used from that client's event loop only. A
    dropped connection is replaced and the command sent once more, as ``ThreadGet`` does;
    no reply within the client's ``socket_timeout`` drops the connection and raises
    ``redis.TimeoutError``.
    """

    def __init__(self, client: aioredis.Redis) -> None:
        self._pool = client.connection_pool
        self._timeout = float(self._pool.connection_kwargs.get("socket_timeout") or 5.0)
        self._replies: _Replies | None = None
        self._lock: asyncio.Lock | None = None
        self._packed: dict[str, bytes] = {}
        self._batch: _Batch | None = None
        self._tasks: set[asyncio.Future[None]] = set()
        self.sent = 0
        """Commands written (telemetry: one per batch)."""

    async def many(self, keys: tuple[str, ...]) -> list[Any]:
        """``MGET keys``, in the tick's batch."""
        return await self._ask(keys)

    async def __call__(self, key: str) -> Any:
        return (await self._ask((key,)))[0]

    async def _ask(self, keys: tuple[str, ...]) -> list[Any]:
        """The values of ``keys``, read in one ``MGET`` with every other key asked for in
        this tick of the loop (group commit: the barriers of many runs that reach their
        ownership check together cost one command and one reply). Each caller gets its own
        keys' values; a failure of the batch's command is every caller's."""
        batch = self._batch
        if batch is None:
            loop = asyncio.get_running_loop()
            batch = self._batch = _Batch(loop.create_future())
            loop.call_soon(self._send, batch)
        at = len(batch.keys)
        batch.keys.extend(keys)
        # Shielded: one caller's cancellation must not fail the others' batch.
        got = await asyncio.shield(batch.reply)
        return got[at : at + len(keys)]

    def _send(self, batch: _Batch) -> None:
        """Write the batch's ``MGET`` (the tick after its first key was asked for)."""
        if self._batch is batch:
            self._batch = None
        replies = self._replies
        if replies is None or replies.lost is not None:
            self._in_task(self._send_connected(batch, retry=True))
        else:
            self._send_on(replies, batch, retry=True)

    def _in_task(self, send: Coroutine[Any, Any, None]) -> None:
        """Connect and send in a task of its own, held until it is done."""
        task = asyncio.ensure_future(send)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send_connected(self, batch: _Batch, *, retry: bool) -> None:
        try:
            replies = await self._connect()
        except BaseException as exc:
            if not batch.reply.done():
                batch.reply.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        self._send_on(replies, batch, retry=retry)

    def _send_on(self, replies: _Replies, batch: _Batch, *, retry: bool) -> None:
        words = [self._arg(k) for k in batch.keys]
        one = len(words) == 1  # a lone key: GET (a key of another type is an error reply)
        command = "GET" if one else "MGET"
        reply = replies.send(
            b"*2\r\n$3\r\nGET\r\n%b" % words[0]
            if one
            else b"*%d\r\n$4\r\nMGET\r\n%b" % (len(words) + 1, b"".join(words))
        )
        self.sent += 1
        loop = asyncio.get_running_loop()
        timer = loop.call_later(self._timeout, self._expire, replies, reply, command)

        def done(r: asyncio.Future[Any]) -> None:
            timer.cancel()
            if batch.reply.done():
                return
            exc = r.exception()
            if exc is None:
                batch.reply.set_result([r.result()] if one else list(r.result()))
            elif retry and isinstance(exc, redis.ConnectionError):
                # A dropped connection: once more on a fresh one, as ``ThreadGet`` does.
                self._in_task(self._send_connected(batch, retry=False))
            else:
                batch.reply.set_exception(exc)

        reply.add_done_callback(done)

    def _expire(self, replies: _Replies, reply: asyncio.Future[Any], command: str) -> None:
        if not reply.done():
            # A late reply must not stay on the connection: it is dropped.
            replies.fail(redis.TimeoutError(f"no reply to {command} within {self._timeout} s"))

    def _arg(self, key: str) -> bytes:
        packed = self._packed.get(key)
        if packed is None:
            if len(self._packed) >= PACKED_KEPT:
                self._packed.clear()
            raw = key.encode()
            packed = self._packed[key] = b"$%d\r\n%b\r\n" % (len(raw), raw)
        return packed

    async def _connect(self) -> _Replies:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._replies is None or self._replies.lost is not None:
                conn = self._pool.connection_class(**self._pool.connection_kwargs)
                await conn.connect()  # type: ignore[no-untyped-call]
                writer = getattr(conn, "_writer", None)
                if writer is None:  # a redis-py whose connections keep no stream writer
                    raise redis.ConnectionError("cannot take over the connection's transport")
                replies = _Replies(writer.transport, conn)
                writer.transport.set_protocol(replies)
                self._replies = replies
            return self._replies

    def close(self) -> None:
        if self._replies is not None:
            self._replies.fail(redis.ConnectionError("closed"))


class _Batch:
    """The keys asked for in one tick of a loop, and the future of their values."""

    __slots__ = ("keys", "reply")

    def __init__(self, reply: asyncio.Future[list[Any]]) -> None:
        self.keys: list[str] = []
        self.reply = reply


class _Replies(asyncio.Protocol):
    """The replies of one connection's pipelined commands, in the order they were sent."""

    def __init__(self, transport: asyncio.BaseTransport, conn: Any) -> None:
        self._transport = cast(asyncio.Transport, transport)
        self._conn = conn  # redis-py's connection object, kept with its transport
        # Error replies become redis-py's own exceptions (NOPERM: NoPermissionError...).
        self._reader = hiredis.Reader(replyError=BaseParser.parse_error)
        self._waiting: collections.deque[asyncio.Future[Any]] = collections.deque()
        self.lost: Exception | None = None

    def send(self, packed: bytes) -> asyncio.Future[Any]:
        reply: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting.append(reply)
        self._transport.write(packed)
        return reply

    def data_received(self, data: bytes) -> None:
        self._reader.feed(data)
        try:
            while (reply := self._reader.gets()) is not False:
                waiter = self._waiting.popleft()  # a reply nobody asked for: IndexError
                if waiter.done():
                    continue  # its caller gave up (cancelled): the reply is still its own
                if isinstance(reply, Exception):
                    waiter.set_exception(reply)
                else:
                    waiter.set_result(reply)
        except (hiredis.ProtocolError, IndexError) as exc:
            self.fail(redis.ConnectionError(f"unreadable reply from Redis: {exc!r}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(redis.ConnectionError(f"Redis closed the connection ({exc or 'EOF'})"))

    def fail(self, error: Exception) -> None:
        """Fail every waiting command with ``error`` and drop the connection."""
        if self.lost is None:
            self.lost = error
            self._transport.abort()
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():  # each its own instance: a raise writes its traceback
                waiter.set_exception(type(error)(*error.args))


_loop_gets: weakref.WeakKeyDictionary[aioredis.Redis, LoopGet] = weakref.WeakKeyDictionary()


def loop_mget(client: aioredis.Redis) -> Callable[[tuple[str, ...]], Awaitable[list[Any]]]:
    """``loop_get``'s ``MGET``: the ownership check and the cancel flag in one round trip."""
    if type(client) is not aioredis.Redis:

        async def mget(keys: tuple[str, ...]) -> list[Any]:
            return list(await client.mget(list(keys)))

        return mget
    got = _loop_gets.get(client)
    if got is None:
        got = _loop_gets[client] = LoopGet(client)
    return got.many


def loop_get(client: aioredis.Redis) -> Callable[[str], Awaitable[Any]]:
    """The ownership check's ``GET`` for ``client``'s event loop: a ``LoopGet`` shared by
    every run using ``client``; a cluster client routes by key and keeps its own ``get``."""
    if type(client) is not aioredis.Redis:
        return client.get
    got = _loop_gets.get(client)
    if got is None:
        got = _loop_gets[client] = LoopGet(client)
    return got


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
