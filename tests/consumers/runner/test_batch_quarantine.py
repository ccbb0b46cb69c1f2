"""Bad records are quarantined (topic + Redis, with the position); nothing is dropped."""

from __future__ import annotations

import os

import pytest
import redis
from codec_support import encode_unchecked, make_event
from confluent_kafka import Consumer, Producer, TopicPartition
from projections_support import applied_total, replayed_states, wait_caught_up

from runlog._settings import Settings
from runlog.consumers import _queries as queries
from runlog.consumers.runner import ProjectionRunner
from runlog.consumers.stores import PROJECTIONS
from runlog.schemas import _codec as codec
from runlog.schemas._models import Event
from runlog.schemas._vocabulary import EventType
from tools.loadgen import LoadGenerator


def _event(run_id: str, seq: int = 1) -> Event:
    return make_event(
        EventType.USER_MESSAGE, {"content": "x"}, run_id=run_id, seq=seq, event_id="e" * 32
    )


def _newer(run_id: str) -> bytes:
    """A record from a future release: unknown fingerprint, envelope says v99."""
    good = codec.encode(_event(run_id))
    body = encode_unchecked(_event(run_id), schema_version=99)[codec.HEADER_LEN :]
    return good[:2] + os.urandom(8) + body


@pytest.mark.timeout(180)
def test_bad_records_are_quarantined_and_nothing_is_dropped(
    test_settings: Settings, redis_client: redis.Redis
) -> None:
    gen = LoadGenerator(test_settings, seed=21)
    good_runs = gen.generate(runs=12, events_per_run=15)
    victim = good_runs[0]  # a good run that also gets a corrupt record
    bad: list[tuple[str, bytes, str]] = [
        (victim, b"garbage bytes", "CorruptRecord"),
        ("bad-fp", codec.MAGIC + os.urandom(8) + b"\x00" * 20, "UnknownFingerprint"),
        ("bad-newer", _newer("bad-newer"), "NewerSchemaVersion"),
        ("bad-seq", encode_unchecked(_event("bad-seq"), seq=0), "ValidationFailed"),
        ("bad-type", encode_unchecked(_event("bad-type"), type="no_such_type"), "CorruptRecord"),
        ("bad-key", codec.encode(_event("someone-else")), "KeyMismatch"),
        ("bad-trunc", codec.encode(_event("bad-trunc"))[:-3], "CorruptRecord"),
    ]
    producer = Producer({**test_settings.kafka_common(), "partitioner": "murmur2_random"})
    for key, value, _ in bad:
        producer.produce(
            test_settings.events_topic, key=key.encode(), value=value, headers=[("h", b"v")]
        )
    assert producer.flush(30) == 0
    more = gen.generate(runs=5, events_per_run=10)  # good runs after the bad records

    ProjectionRunner(test_settings, redis_client, PROJECTIONS).catch_up(timeout_s=90)
    highs = wait_caught_up(redis_client, test_settings, timeout=30)

    # Every offset is either applied or quarantined, in every projection.
    for name in PROJECTIONS:
        assert applied_total(redis_client, test_settings, name) == sum(highs.values())
        rows = queries.positions(redis_client, test_settings, name)
        assert sum(int(r["quarantined"] or 0) for r in rows.values()) == len(bad)

    recs = queries.quarantined(redis_client, test_settings)
    got = sorted((r["run_id"], r["error"]) for r in recs)
    assert got == sorted((k, e) for k, _, e in bad)
    by_run = {r["run_id"]: r for r in recs}
    assert by_run["bad-fp"]["projections"] == list(PROJECTIONS)
    import base64

    for key, value, _ in bad:
        assert base64.b64decode(by_run[key]["value_b64"]) == value
        assert by_run[key]["headers"] == [["h", base64.b64encode(b"v").decode()]]

    # The run is marked; its good events still fold as the writers' rule says.
    view = queries.get_state(redis_client, test_settings, victim)
    assert view is not None
    assert [q["error"] for q in view["quarantined"]] == ["CorruptRecord"]
    assert view["state"]["status"] == "finished"
    summary = queries.get_summary(redis_client, test_settings, victim)
    assert summary is not None and summary["quarantined"] == "1"
    audit = queries.get_audit(redis_client, test_settings, victim)
    assert [e["error"] for e in audit if e["kind"] == "quarantined"] == ["CorruptRecord"]

    # Other runs keep projecting, equal to the fold.
    others = [r for r in good_runs + more if r != victim]
    expected = replayed_states(test_settings, others)
    for rid in others:
        got_view = queries.get_state(redis_client, test_settings, rid)
        assert got_view is not None and got_view["state"] == expected[rid]
        assert got_view["quarantined"] == []

    # The original bytes and headers are on the quarantine topic (one copy per runner
    # that quarantined them: here one runner for all three projections).
    consumer = Consumer(
        {**test_settings.kafka_common(), "group.id": "q-check", "enable.partition.eof": False}
    )
    try:
        found: list[bytes] = []
        tps = [
            TopicPartition(test_settings.quarantine_topic, p, 0)
            for p in range(test_settings.partitions)
        ]
        consumer.assign(tps)
        for _ in range(60):
            for msg in consumer.consume(100, timeout=0.5):
                if msg.error() is None:
                    found.append(msg.value())
                    hdrs = dict(msg.headers() or [])
                    assert hdrs["h"] == b"v"
                    assert hdrs["runlog.quarantine.error"]
            if len(found) >= len(bad):
                break
        assert sorted(found) == sorted(v for _, v, _ in bad)
    finally:
        consumer.close()


def test_transient_redis_errors_are_retried_not_skipped(
    test_settings: Settings, redis_client: redis.Redis
) -> None:
    runner = ProjectionRunner(test_settings, redis_client, ("state",))
    calls = {"n": 0}

    def flaky() -> str:
        calls["n"] += 1
        if calls["n"] < 4:
            raise redis.ConnectionError("connection reset")
        return "done"

    assert runner.retrier.retry("flaky", flaky) == "done"
    assert calls["n"] == 4 and runner.stats.retries == 3

    def broken() -> None:
        raise ValueError("a bug is not transient")

    with pytest.raises(ValueError):
        runner.retrier.retry("broken", broken)
