"""The lease check's GET over a connection of the calling thread's own (``ThreadGet``), and
its asyncio form, pipelined over one connection per client (``LoopGet``).

It answers the one question fencing rests on ("is this still my lease?"), so each way a
private connection can go wrong is tried against the real Redis: a reply left unread by an
interrupted exchange, a connection the server dropped, a socket inherited by a fork, and
threads sharing one ``ThreadGet``.
"""

from __future__ import annotations

import asyncio
import os
import threading
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import redis

from runlog._settings import Settings
from runlog.log._clients import LoopGet, ThreadGet, async_redis_client, loop_get, redis_client


@pytest.fixture
def keys(redis_client: redis.Redis) -> dict[str, str]:
    tag = uuid.uuid4().hex[:8]
    pairs = {f"threadget:{tag}:{i}": f"value-{i}" for i in range(8)}
    redis_client.mset(pairs)
    yield pairs
    redis_client.delete(*pairs)


@pytest.fixture
def get(settings: Settings) -> ThreadGet:
    client = redis_client(settings)
    got = ThreadGet(client, own_after=0)  # a connection of its own from the first ask
    yield got
    got.close()
    client.close()


def _conn(get: ThreadGet) -> object:
    return get._local.held[1]


def test_an_interrupted_get_leaves_no_reply_for_the_next(
    get: ThreadGet, keys: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = list(keys)[:2]
    assert get(first) == b"value-0"
    conn = _conn(get)
    real = type(conn).read_response

    def interrupted(self: object, *a: object, **kw: object) -> object:
        monkeypatch.setattr(type(conn), "read_response", real)
        raise KeyboardInterrupt  # after the GET was sent, before its reply was read

    monkeypatch.setattr(type(conn), "read_response", interrupted)
    with pytest.raises(KeyboardInterrupt):
        get(first)
    # The reply to the interrupted GET of `first` must not answer this one.
    assert get(second) == b"value-1"
    assert get(first) == b"value-0"


def test_a_connection_the_server_dropped_is_replaced(
    get: ThreadGet, keys: dict[str, str], redis_client: redis.Redis
) -> None:
    key = next(iter(keys))
    assert get(key) == b"value-0"
    conn = _conn(get)
    conn.send_command("CLIENT", "ID")
    own_id = conn.read_response()
    assert redis_client.client_kill_filter(_id=own_id) == 1
    assert get(key) == b"value-0"


def test_a_forked_child_does_not_share_the_parents_socket(
    get: ThreadGet, keys: dict[str, str]
) -> None:
    names = list(keys)
    assert get(names[0]) == b"value-0"
    parent_conn = _conn(get)
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: many GETs over what would be the parent's socket
        ok = all(get(k) == v.encode() for _ in range(200) for k, v in keys.items())
        ok = ok and _conn(get) is not parent_conn
        os.write(write_fd, b"1" if ok else b"0")
        os._exit(0)
    os.close(write_fd)
    # Meanwhile the parent keeps asking on its own connection.
    for _ in range(200):
        for k, v in keys.items():
            assert get(k) == v.encode()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert os.read(read_fd, 1) == b"1"
    os.close(read_fd)
    assert _conn(get) is parent_conn


def test_threads_each_get_their_own_answers(get: ThreadGet, keys: dict[str, str]) -> None:
    barrier = threading.Barrier(len(keys))
    wrong: list[tuple[str, object]] = []

    def ask(key: str, value: str) -> None:
        barrier.wait()
        for _ in range(300):
            got = get(key)
            if got != value.encode():
                wrong.append((key, got))

    threads = [threading.Thread(target=ask, args=kv) for kv in keys.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []


def test_a_thread_that_asks_once_borrows_a_pooled_connection(
    settings: Settings, keys: dict[str, str]
) -> None:
    """Threads that each ask a few times (a run opened from a thread of its own) make no
    connection each: they borrow the pool's. A thread that asks more gets its own."""
    client = redis_client(settings)
    get = ThreadGet(client, own_after=2)
    try:
        names = list(keys)
        barrier = threading.Barrier(20)
        answers: list[object] = []

        def once() -> None:
            barrier.wait()
            answers.append(get.many(tuple(names[:2])))
            answers.append(get.many(tuple(names[:2])))

        threads = [threading.Thread(target=once) for _ in range(20)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert answers == [[b"value-0", b"value-1"]] * 40
        assert len(get._conns) == 0
        assert get(names[2]) == b"value-2" and get(names[4]) == b"value-4"  # borrowed
        assert len(get._conns) == 0
        assert get(names[3]) == b"value-3"  # its third: a connection of its own
        assert len(get._conns) == 1 and get(names[0]) == b"value-0"
    finally:
        get.close()
        client.close()


def test_packed_gets_answer_their_own_key_past_the_cache(
    get: ThreadGet,
    keys: dict[str, str],
    redis_client: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each key's packed GET is kept; a full cache is emptied, never answers for another key."""
    monkeypatch.setattr("runlog.log._clients.PACKED_KEPT", 3)
    odd = f"threadget:{uuid.uuid4().hex[:8]}:é {{tag}} \r\n$3"  # UTF-8, braces, RESP bytes
    redis_client.set(odd, "odd")
    try:
        for _ in range(3):
            for key, value in keys.items():
                assert get(key) == value.encode()
            assert get(odd) == b"odd"
        assert len(get._packed) <= 3
        redis_client.set(odd, "changed")  # what is kept is the question, never the answer
        assert get(odd) == b"changed"
    finally:
        redis_client.delete(odd)


# LoopGet: the asyncio barrier's GET ------------------------------------------------------


def _in_loop(settings: Settings, body: Callable[[LoopGet], Awaitable[Any]], **kw: Any) -> Any:
    async def main() -> Any:
        client = async_redis_client(settings, **kw)
        got = loop_get(client)
        assert isinstance(got, LoopGet)
        try:
            return await body(got)
        finally:
            got.close()
            await client.aclose()

    return asyncio.run(main())


def test_concurrent_loop_gets_each_get_their_own_reply(
    settings: Settings, keys: dict[str, str]
) -> None:
    """Hundreds of GETs in flight at once on one connection: each gets its own key's reply."""
    missing = f"threadget:{uuid.uuid4().hex}:absent"
    asked = [*keys, missing] * 60

    async def body(get: LoopGet) -> None:
        answers = await asyncio.gather(*(get(k) for k in asked))
        expected = [keys[k].encode() if k in keys else None for k in asked]
        assert answers == expected
        assert get._replies is not None and get._replies.lost is None  # one connection

    _in_loop(settings, body)


def test_a_cancelled_loop_get_leaves_no_reply_for_the_next(
    settings: Settings, keys: dict[str, str]
) -> None:
    first, second = list(keys)[:2]

    async def body(get: LoopGet) -> None:
        assert await get(first) == b"value-0"
        connection = get._replies
        asked = asyncio.ensure_future(get(first))
        await asyncio.sleep(0)  # sent, its reply not read yet
        asked.cancel()
        # The reply to the cancelled GET of `first` must not answer this one.
        assert await get(second) == b"value-1"
        assert await get(first) == b"value-0"
        assert asked.cancelled()
        assert get._replies is connection and connection.lost is None  # skipped, not failed

    _in_loop(settings, body)


def test_a_loop_get_connection_the_server_dropped_is_replaced(
    settings: Settings, keys: dict[str, str], redis_client: redis.Redis
) -> None:
    key = next(iter(keys))

    async def body(get: LoopGet) -> None:
        assert await get(key) == b"value-0"
        dropped = get._replies
        assert dropped is not None
        host, port = dropped._transport.get_extra_info("sockname")[:2]
        assert redis_client.client_kill_filter(addr=f"{host}:{port}") == 1
        assert await get(key) == b"value-0"  # the GET is sent again on a fresh connection
        assert get._replies is not dropped and dropped.lost is not None

    _in_loop(settings, body)


def test_a_loop_get_without_a_reply_in_time_times_out_and_reconnects(
    settings: Settings, keys: dict[str, str], redis_client: redis.Redis
) -> None:
    key = next(iter(keys))

    async def body(get: LoopGet) -> None:
        assert await get(key) == b"value-0"
        stalled = get._replies
        redis_client.execute_command("CLIENT", "PAUSE", "1500", "ALL")
        with pytest.raises(redis.TimeoutError, match="no reply to GET"):
            await get(key)
        assert stalled is not None and stalled.lost is not None  # a late reply is not kept
        await asyncio.sleep(1.6)
        assert await get(key) == b"value-0"
        assert get._replies is not stalled

    _in_loop(settings, body, socket_timeout=0.5)


def test_a_loop_get_error_reply_is_redis_pys_error_and_the_connection_goes_on(
    settings: Settings, keys: dict[str, str], redis_client: redis.Redis
) -> None:
    key = next(iter(keys))
    hashed = f"threadget:{uuid.uuid4().hex[:8]}:hash"
    redis_client.hset(hashed, "a", "1")

    async def body(get: LoopGet) -> None:
        with pytest.raises(redis.ResponseError):  # the error reply, whatever its words
            await get(hashed)
        assert await get(key) == b"value-0"

    try:
        _in_loop(settings, body)
    finally:
        redis_client.delete(hashed)
