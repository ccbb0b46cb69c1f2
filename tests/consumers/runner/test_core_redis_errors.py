"""A Redis that is up but refuses writes makes the projection runner wait, not die.

READONLY (a replica, or a primary demoted by a failover), OOM (``maxmemory`` reached under
``noeviction``) and BUSY (a long script) are replies, not connection errors: the runner
backs off (capped) and retries the batch, and once Redis takes writes again the
projection ends exactly as if nothing had happened. Each fault is made on a
``redis-server`` of the test's own (``tools.redis_server``), never on the session's shared
one, whose other clients (tests running beside this one) would meet it too.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import redis
from projections_support import applied_total, replayed_states, wait_caught_up

from runlog._settings import Settings
from runlog.consumers import _queries as queries
from runlog.consumers.runner import ProjectionRunner, transient_redis_error
from runlog.consumers.stores import PROJECTIONS
from tools.loadgen import LoadGenerator
from tools.redis_server import PrivateRedis


@contextmanager
def _oom(client: redis.Redis) -> Iterator[Callable[[], None]]:
    policy = client.config_get("maxmemory-policy")["maxmemory-policy"]
    limit = client.config_get("maxmemory")["maxmemory"]
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", 1)

    def heal() -> None:
        client.config_set("maxmemory", limit)
        client.config_set("maxmemory-policy", policy)

    try:
        yield heal
    finally:
        heal()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextmanager
def _readonly(client: redis.Redis) -> Iterator[Callable[[], None]]:
    # A replica of a primary that does not answer keeps its data and refuses writes.
    client.execute_command("REPLICAOF", "127.0.0.1", str(_closed_port()))

    def heal() -> None:
        client.execute_command("REPLICAOF", "NO", "ONE")

    try:
        yield heal
    finally:
        heal()


@contextmanager
def _busy(client: redis.Redis) -> Iterator[Callable[[], None]]:
    threshold = client.config_get("busy-reply-threshold")["busy-reply-threshold"]
    client.config_set("busy-reply-threshold", 100)
    spinner = redis.Redis(
        connection_pool=redis.ConnectionPool(**client.connection_pool.connection_kwargs)
    )
    started = threading.Event()

    def spin() -> None:
        started.set()
        with contextlib.suppress(redis.RedisError):  # killed below
            spinner.eval("while true do end", 0)

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    started.wait()
    time.sleep(0.3)  # past the threshold: every other client now gets BUSY

    def heal() -> None:
        if thread.is_alive():
            while True:
                try:
                    client.execute_command("SCRIPT", "KILL")
                    break
                except redis.ResponseError as exc:
                    if "NOTBUSY" in str(exc):
                        break
                    time.sleep(0.05)
            thread.join(timeout=10)
            client.config_set("busy-reply-threshold", threshold)

    try:
        yield heal
    finally:
        heal()
        spinner.close()


FAULTS = {"OOM": _oom, "READONLY": _readonly, "BUSY": _busy}


def test_the_replies_are_recognised_as_transient() -> None:
    assert transient_redis_error(redis.ResponseError("BUSY Redis is busy running a script."))
    assert transient_redis_error(
        redis.ResponseError("Command # 1 (SET x 1) of pipeline caused error: BUSY Redis is busy")
    )
    assert transient_redis_error(redis.exceptions.ReadOnlyError("You can't write"))
    assert transient_redis_error(redis.exceptions.OutOfMemoryError("command not allowed"))
    assert not transient_redis_error(redis.ResponseError("BUSYGROUP Consumer Group name exists"))
    assert not transient_redis_error(redis.ResponseError("WRONGTYPE Operation against a key"))


@pytest.fixture
def own_redis(test_settings: Settings) -> Iterator[tuple[Settings, redis.Redis]]:
    """This test's settings on a Redis of its own, and a client of it."""
    server = PrivateRedis()
    client = redis.Redis.from_url(server.url)
    try:
        yield test_settings.model_copy(update={"redis_url": server.url}), client
    finally:
        client.close()
        server.stop()


@pytest.mark.parametrize("fault", sorted(FAULTS))
@pytest.mark.timeout(180)
def test_the_runner_backs_off_and_applies_everything_once_redis_heals(
    own_redis: tuple[Settings, redis.Redis], fault: str
) -> None:
    test_settings, redis_client = own_redis
    runs = LoadGenerator(test_settings, seed=51).generate(runs=6, events_per_run=12)
    runner_client = redis.Redis.from_url(test_settings.redis_url)
    runner = ProjectionRunner(test_settings, runner_client, PROJECTIONS)
    errors: list[BaseException] = []

    def catch_up() -> None:
        try:
            runner.catch_up(timeout_s=120)
        except Exception as exc:  # noqa: BLE001 - the test reports it
            errors.append(exc)

    thread = threading.Thread(target=catch_up, daemon=True)
    with FAULTS[fault](redis_client) as heal:
        thread.start()
        deadline = time.monotonic() + 30
        while runner.stats.retries < 2:
            assert not errors, f"the runner died on {fault}: {errors[0]!r}"
            assert time.monotonic() < deadline, f"the runner never met {fault}"
            time.sleep(0.05)
        if fault != "BUSY":  # a busy Redis answers no reads either
            assert applied_total(redis_client, test_settings, "state") == 0
        heal()
    thread.join(timeout=120)
    runner_client.close()
    assert not errors, f"the runner died on {fault}: {errors[0]!r}"

    highs = wait_caught_up(redis_client, test_settings, timeout=30)
    for name in PROJECTIONS:
        assert applied_total(redis_client, test_settings, name) == sum(highs.values())
    expected = replayed_states(test_settings, runs)
    for rid in runs:
        view = queries.get_state(redis_client, test_settings, rid)
        assert view is not None and view["state"] == expected[rid]
