"""One run's replay cost must not grow with the other runs in its partition (ARCHITECTURE, Scale).

Measures a run replayed alone in its partition and the same run replayed from a partition
it shares with many other runs (before, during and after it), both seeking by the start
index. Prints the ratio; asserts only correctness (timing on a shared machine is noise).
"""

from __future__ import annotations

import time

import redis
from replay_support import OPS, synthetic_log

from runlog._settings import Settings
from runlog._topics import ensure_topics
from runlog.log._replay import replay
from runlog.producers._writer import EventWriter
from runlog.schemas import _codec as codec
from runlog.schemas._keys import new_run_id, partition_for, start_key
from runlog.schemas._models import Event

RUN_OPS = [OPS[i % 10] for i in range(300)]  # no finish, no fenced ops: a long, busy run
OTHERS = 40
OTHER_EVENTS = 60


def _send(writer: EventWriter, topic: str, events: list[Event]) -> list[int]:
    futs = [
        writer.send(topic, e.run_id.encode(), codec.encode(e), codec.headers(e)) for e in events
    ]
    return [f.result(timeout=30).offset for f in futs]


def _interleave(a: list[Event], others: list[list[Event]]) -> list[Event]:
    """A third of the others before the run, a third interleaved with it, a third after."""
    third = len(others) // 3
    before = [e for run in others[:third] for e in run]
    during = others[third : 2 * third]
    after = [e for run in others[2 * third :] for e in run]
    mixed: list[Event] = []
    iters = [iter(r) for r in during]
    for ev in a:
        mixed.append(ev)
        for it in iters:
            nxt = next(it, None)
            if nxt is not None:
                mixed.append(nxt)
    mixed += [e for it in iters for e in it]
    return before + mixed + after


def _measure(
    s: Settings, client: redis.Redis, run_id: str, tenant: str
) -> tuple[float, tuple[str, int]]:
    best = float("inf")
    digest = ("", 0)
    for _ in range(3):
        t0 = time.perf_counter()
        r = replay(s, client, run_id, tenant=tenant)
        best = min(best, time.perf_counter() - t0)
        assert r.source == "index"
        digest = (r.state.digest(), r.records)
    return best * 1000, digest


def test_replay_cost_does_not_grow_with_other_runs(
    test_settings: Settings, redis_client: redis.Redis
) -> None:
    alone = test_settings
    shared = test_settings.model_copy(
        update={
            "partitions": 1,
            "topic_prefix": test_settings.topic_prefix + "-shared",
            "redis_key_prefix": test_settings.redis_key_prefix + "-shared",
        }
    )
    ensure_topics(shared).raise_for_drift()
    run_id = new_run_id()
    a = synthetic_log(RUN_OPS, 7, run_id=run_id)
    others = [
        synthetic_log([OPS[(i + j) % 10] for j in range(OTHER_EVENTS)], i, run_id=new_run_id())
        for i in range(OTHERS)
    ]
    writer = EventWriter(test_settings)
    try:
        offs = _send(writer, alone.events_topic, a)
        home = partition_for(run_id, alone.partitions)  # where the producer's hash put it
        redis_client.set(start_key(alone.redis_key_prefix, "t", run_id), f"{home}:{offs[0]}")
        mixed = _interleave(a, others)
        offs = _send(writer, shared.events_topic, mixed)
        first = offs[next(i for i, e in enumerate(mixed) if e.run_id == run_id)]
        redis_client.set(start_key(shared.redis_key_prefix, "t", run_id), f"0:{first}")
    finally:
        writer.close()

    try:
        alone_ms, d1 = _measure(alone, redis_client, run_id, "t")
        shared_ms, d2 = _measure(shared, redis_client, run_id, "t")
    finally:
        from confluent_kafka.admin import AdminClient

        AdminClient(shared.kafka_common()).delete_topics(
            [shared.events_topic, shared.quarantine_topic]
        )
    assert d1[1] == d2[1] == len(a), (d1, d2)  # every record of the run, either way
    assert d1[0] == d2[0]  # and the same state
    ratio = shared_ms / alone_ms
    print(
        f"\nreplay of {len(a)} events: alone {alone_ms:.1f} ms; sharing its partition with "
        f"{OTHERS} runs ({len(mixed) - len(a)} other records, "
        f"{len(mixed) - (first)} records from its start to the end) {shared_ms:.1f} ms; "
        f"ratio {ratio:.2f}"
    )
