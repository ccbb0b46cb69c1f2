"""A projection's stored position that goes back, and a rebuild under a live runner.

Redis can go back in time under a running projection service: a failover to a replica
that missed the last writes, an AOF that lost its last second, a key deleted or evicted.
The live runner must then refold from the stored position (never write a batch that does
not continue it, or the records in between are skipped for good), and must not fold a
record twice where the effects survived but the position did not. A rebuild fences live
runners instead of racing them. Every scenario ends by comparing the live projection,
byte for byte, with a rebuild from offset zero.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from projections_support import dump, wait_caught_up

from runlog._settings import Settings
from runlog.consumers._store import ProjectionKeys
from runlog.consumers.runner import ProjectionRunner, rebuild
from runlog.consumers.stores import PROJECTIONS
from tools.loadgen import LoadGenerator

FAST_GROUP = {"session.timeout.ms": 6000, "heartbeat.interval.ms": 500}


class Live:
    """A projection service running in a thread, as ``runlog project all`` runs it."""

    def __init__(self, settings: Settings, group: str) -> None:
        self.client = redis.Redis.from_url(settings.redis_url)
        self.runner = ProjectionRunner(
            settings, self.client, PROJECTIONS, group=group, consumer_extra=FAST_GROUP
        )
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while len(self.runner._assigned) < settings.partitions:
            assert self.error is None, self.error
            assert time.monotonic() < deadline, "the live runner was not assigned"
            time.sleep(0.05)

    def _run(self) -> None:
        try:
            self.runner.run()
        except BaseException as exc:
            self.error = exc
            raise

    def applied(self) -> int:
        return sum(self.runner.stats.applied.values())

    def stop(self) -> None:
        self.runner.stop()
        self.thread.join(timeout=30)
        self.client.close()
        assert self.error is None, f"the live runner died: {self.error!r}"


@pytest.fixture
def live(test_settings: Settings, unique_group: Callable[..., str]) -> Iterator[Live]:
    svc = Live(test_settings, unique_group("live"))
    try:
        yield svc
    finally:
        if svc.thread.is_alive():
            svc.stop()


def _keys_each(settings: Settings) -> list[ProjectionKeys]:
    """The key names of each of the three projections."""
    return [
        ProjectionKeys(settings.redis_key_prefix, name, settings.events_topic)
        for name in PROJECTIONS
    ]


def _projection_keys(client: redis.Redis, settings: Settings) -> list[bytes]:
    out: list[bytes] = []
    for keys in _keys_each(settings):
        out += list(client.scan_iter(match=keys.pattern(), count=1000))
    return out


def _load(
    settings: Settings, client: redis.Redis, *, seed: int, runs: int, events_per_run: int
) -> LoadGenerator:
    """A generator that has written a first load, once the projections have folded it."""
    gen = LoadGenerator(settings, seed=seed)
    gen.generate(runs=runs, events_per_run=events_per_run)
    wait_caught_up(client, settings)
    return gen


def _save(client: redis.Redis, settings: Settings) -> dict[bytes, Any]:
    """Every key of the three projections as DUMP payloads: Redis as of now."""
    return {k: client.dump(k) for k in _projection_keys(client, settings)}


def _restore(client: redis.Redis, settings: Settings, saved: dict[bytes, Any]) -> None:
    """Put Redis back to what ``_save`` saw: later writes are lost, as after an AOF loss."""
    with client.pipeline(transaction=True) as pipe:
        for key in _projection_keys(client, settings):
            pipe.delete(key)
        for key, payload in saved.items():
            pipe.restore(key, 0, payload, replace=True)
        pipe.execute()


def _same_as_a_rebuild(client: redis.Redis, settings: Settings, live: Live) -> None:
    wait_caught_up(client, settings, timeout=60)
    live.stop()
    got = dump(client, settings)
    rebuild(client, settings, PROJECTIONS)
    assert got == dump(client, settings), "the live projection differs from a rebuild"


def test_redis_going_back_in_time_refolds_what_it_lost(
    test_settings: Settings, redis_client: redis.Redis, live: Live
) -> None:
    """Positions and effects go back together (AOF loss, failover): nothing is skipped."""
    gen = _load(test_settings, redis_client, seed=41, runs=6, events_per_run=15)
    saved = _save(redis_client, test_settings)
    gen.generate(runs=6, events_per_run=15)
    wait_caught_up(redis_client, test_settings)

    _restore(redis_client, test_settings, saved)  # Redis forgot the second load
    gen.generate(runs=3, events_per_run=10)  # new traffic on top of the regressed Redis
    _same_as_a_rebuild(redis_client, test_settings, live)
    assert live.runner.stats.regressions >= 1


@pytest.mark.parametrize("how", ["set_back", "deleted"])
def test_a_position_that_went_back_alone_folds_nothing_twice(
    test_settings: Settings, redis_client: redis.Redis, live: Live, how: str
) -> None:
    """Only the position went back (reset or deleted by hand, evicted): the effects it
    covers are still there, so refolding from it must not apply a record twice."""
    gen = _load(test_settings, redis_client, seed=42, runs=6, events_per_run=15)
    for keys in _keys_each(test_settings):
        for p in range(test_settings.partitions):
            pos = redis_client.get(keys.pos(p))
            if pos is None:
                continue  # no record hashed to this partition
            if how == "deleted":
                redis_client.delete(keys.pos(p))
            else:
                redis_client.set(keys.pos(p), int(pos) // 2)
    applied, sent = live.applied(), gen.sent
    gen.generate(runs=3, events_per_run=10)
    _same_as_a_rebuild(redis_client, test_settings, live)
    assert live.runner.stats.regressions >= 1
    # Only the new records were folded; the refetched ones were recognised as applied.
    assert live.applied() - applied == (gen.sent - sent) * len(PROJECTIONS)


def test_a_rebuild_fences_a_live_runner_instead_of_racing_it(
    test_settings: Settings, redis_client: redis.Redis, live: Live
) -> None:
    gen = _load(test_settings, redis_client, seed=43, runs=8, events_per_run=20)
    seen: dict[str, Any] = {}

    def during_rebuild(done: int, total: int) -> None:
        if seen:
            return
        # Records after the rebuild's end point: the live runner's, once the rebuild is done.
        seen["before"] = live.applied()
        seen["runs"] = gen.generate(runs=4, events_per_run=10)
        time.sleep(2.5)  # an unfenced runner folds them within ~0.1 s
        seen["after"] = live.applied()
        seen["waiting"] = getattr(live.runner, "_waiting", False)

    rebuild(redis_client, test_settings, PROJECTIONS, progress=during_rebuild)
    assert seen, "the rebuild reported no progress"
    assert seen["after"] == seen["before"], "the live runner wrote while the rebuild ran"
    assert seen["waiting"] and live.runner.stats.fenced >= 1

    # The rebuild is over: the live runner continues from the rebuilt positions.
    deadline = time.monotonic() + 30
    while live.runner._waiting:
        assert time.monotonic() < deadline, "the live runner never resumed"
        time.sleep(0.1)
    _same_as_a_rebuild(redis_client, test_settings, live)
    assert live.applied() > seen["after"]


def test_a_rebuild_that_dies_frees_the_live_runners(
    test_settings: Settings, redis_client: redis.Redis, live: Live
) -> None:
    """The marker has a TTL: a crashed rebuild does not stop the projection for good."""
    gen = _load(test_settings, redis_client, seed=44, runs=4, events_per_run=10)
    for keys in _keys_each(test_settings):
        redis_client.set(keys.rebuild_marker(), "{}", px=1500)  # a rebuild that never renews
        for p in range(test_settings.partitions):
            redis_client.incr(keys.gen(p))
    gen.generate(runs=2, events_per_run=10)
    _same_as_a_rebuild(redis_client, test_settings, live)
    assert live.runner.stats.fenced >= 1


def test_a_partition_revoked_while_paused_for_a_rebuild_is_read_again_when_reassigned(
    test_settings: Settings, redis_client: redis.Redis, unique_group: Callable[..., str]
) -> None:
    """A runner paused for a rebuild loses its partitions (a rebalance) before the rebuild
    ends, so its resume names none; when they come back they must be read. librdkafka
    keeps a partition's pause across the revocation and the new assignment: before the
    fix, the runner's partitions stayed paused for ever (the explorer's seed 306: a broker
    restart's session timeout during a dead rebuild's completion)."""
    from confluent_kafka import TopicPartition

    LoadGenerator(test_settings, seed=43).generate(runs=3, events_per_run=5)
    runner = ProjectionRunner(
        test_settings,
        redis_client,
        PROJECTIONS,
        group=unique_group("paused"),
        consumer_extra=FAST_GROUP,
    )
    marker = ProjectionKeys(
        test_settings.redis_key_prefix, PROJECTIONS[0], test_settings.events_topic
    ).rebuild_marker()
    consumer = runner._consumer = runner._make_consumer()
    parts = [TopicPartition(test_settings.events_topic, p) for p in range(test_settings.partitions)]
    try:
        redis_client.set(marker, "a rebuild", ex=60)
        runner._on_assign(consumer, parts)  # paused: a rebuild holds the projections
        assert runner._waiting
        assert consumer.consume(100, timeout=1.0) == []  # polled while paused, as it waits
        runner._on_revoke(consumer, parts)
        consumer.unassign()
        redis_client.delete(marker)
        assert runner.fence.over()
        runner._resume_after_rebuild()  # over while revoked: resumes no partition
        assert not runner._waiting
        runner._on_assign(
            consumer, [TopicPartition(test_settings.events_topic, p) for p in range(len(parts))]
        )
        got = 0
        deadline = time.monotonic() + 20
        while got == 0 and time.monotonic() < deadline:
            got += len(consumer.consume(100, timeout=0.5))
        assert got > 0, "the reassigned partitions stayed paused"
    finally:
        redis_client.delete(marker)
        runner.close()
