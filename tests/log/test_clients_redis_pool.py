"""One process's Redis client under more threads than it has connections."""

from __future__ import annotations

import threading

from runlog._settings import Settings
from runlog.log._clients import REDIS_ERRORS, SYNC_CONNECTIONS, redis_client


def test_threads_beyond_the_pool_wait_for_a_connection_instead_of_failing(
    test_settings: Settings,
) -> None:
    """Each thread holds a connection for a moment (a blocking pop on an empty list);
    half again as many threads as the pool holds, released together, all get an answer.
    A pool that refuses its 101st connection failed a third of them."""
    client = redis_client(test_settings)
    n = SYNC_CONNECTIONS + SYNC_CONNECTIONS // 2
    gate = threading.Barrier(n)
    failures: list[BaseException] = []
    answers: list[object] = []
    lock = threading.Lock()
    key = f"{test_settings.redis_key_prefix}:pool-test:empty"

    def one() -> None:
        gate.wait()
        try:
            got = client.blpop([key], timeout=0.3)
            with lock:
                answers.append(got)
        except REDIS_ERRORS as exc:
            with lock:
                failures.append(exc)

    threads = [threading.Thread(target=one) for _ in range(n)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    finally:
        client.close()
    assert not failures, f"{len(failures)} of {n} failed: {failures[0]!r}"
    assert answers == [None] * n
