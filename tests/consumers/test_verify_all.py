"""``runlog verify --all`` verifies runs, and a record keyed by no valid run id is no run.

Some other producer may write into the events topic: a record without a key, with a key
that is not UTF-8 or not a valid run id belongs to no run (the projections quarantine
it). ``verify --all`` listed such keys as runs and failed on each ("no records of run"),
so one stray record made the operator's check fail forever. Found by the fault explorer
(hostile records, seed 2).
"""

from __future__ import annotations

import redis
from confluent_kafka import Producer
from workers.common import services_for

import runlog
from runlog._settings import Settings
from runlog.consumers._verify import list_runs
from runlog.log._setaside import set_aside


def test_records_keyed_by_no_valid_run_are_not_listed_as_runs(test_settings: Settings) -> None:
    with services_for(test_settings):
        run = runlog.open_run(settings=test_settings, tenant="acme")
        run.finish("succeeded")
    producer = Producer(test_settings.kafka_common())
    topic = test_settings.events_topic
    for key in (None, b"\xff\xfe\xfd", b"bad key*{x}", b"", b"a\x1fb"):
        producer.produce(topic, b"\x00junk", key, partition=0)
    producer.flush(30)
    assert list_runs(test_settings) == [("acme", run.run_id)]


def test_a_key_whose_only_record_was_set_aside_is_no_run(
    test_settings: Settings, redis_client: redis.Redis
) -> None:
    """An operator set aside the one undecodable record under a run id: readers skip it,
    so ``verify --all`` has no run there to fail on (it failed with "no records of run").
    """
    with services_for(test_settings):
        run = runlog.open_run(settings=test_settings)
        run.finish("succeeded")
    producer = Producer(test_settings.kafka_common())
    got: list[tuple[int, int]] = []
    producer.produce(
        test_settings.events_topic,
        b"\x1d\x15 not avro",
        "ghost-run",
        partition=1,
        on_delivery=lambda err, msg: got.append((msg.partition(), msg.offset())),
    )
    producer.flush(30)
    assert [r for _, r in list_runs(test_settings, client=redis_client)] == sorted(
        [run.run_id, "ghost-run"]
    )
    ((part, offset),) = got
    set_aside(redis_client, test_settings, part, offset, by="ops", reason="junk", error="x")
    assert list_runs(test_settings, client=redis_client) == [("default", run.run_id)]
