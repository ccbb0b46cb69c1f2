"""A run lives in one partition for life, even when someone adds partitions to the topic.

Kafka hashes a key over the partition count it knows *now*. After partitions are added the
same run id hashes elsewhere: a reader that trusted the hash would find nothing and start
the run again at seq 1 (a payment made twice), and a live producer that refreshed its
metadata would split the run over two partitions. These tests add partitions to a real
topic under a real worker and check the log, the ledger and the errors.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import pytest
import redis
from confluent_kafka.admin import AdminClient, NewPartitions
from scan_support import events_records
from workers.common import EXIT_OK, Ledger, assert_log_sound, services_for, start_worker

import runlog
from runlog._settings import Settings
from runlog.errors import ConfigError
from runlog.log._reader import LogReader
from runlog.schemas._keys import new_run_id, partition_for, start_key

pytestmark = pytest.mark.timeout(120)

GROWN = 6


def _moving_run_id(settings: Settings) -> str:
    """A run id that hashes to another partition once the topic has GROWN partitions."""
    while True:
        rid = new_run_id()
        if partition_for(rid, settings.partitions) != partition_for(rid, GROWN):
            return rid


def _grow(settings: Settings) -> None:
    admin = AdminClient(settings.kafka_common())
    futures = admin.create_partitions([NewPartitions(settings.events_topic, GROWN)])
    for fut in futures.values():
        fut.result(timeout=30)


def _partitions_holding(settings: Settings, run_id: str) -> dict[int, int]:
    """Records keyed ``run_id`` per partition, read straight from every partition."""
    key = run_id.encode()
    return dict(Counter(m.partition() or 0 for m in events_records(settings) if m.key() == key))


def test_partitions_added_under_a_live_writer_do_not_split_its_run(
    fast: Settings, tmp_path: Path, ledger: Ledger
) -> None:
    rid = _moving_run_id(fast)
    home = partition_for(rid, fast.partitions)
    # A producer that refreshes its metadata often sees the new partitions at once.
    refresh = '{"topic.metadata.refresh.interval.ms": "100"}'
    worker = start_worker(
        fast,
        tmp_path,
        "live",
        "--run-id",
        rid,
        "--charge-mode",
        "block-after",
        RUNLOG_KAFKA_EXTRA=refresh,
    )
    worker.wait_flag("effect")  # the charge happened; COMPLETED and the rest are still to come
    _grow(fast)
    time.sleep(1.0)  # ten refreshes: the worker's producer now hashes over GROWN partitions
    worker.go()
    code, result = worker.finish()
    assert code == EXIT_OK, result.get("_stderr")
    assert result["status"] == "finished"
    assert _partitions_holding(fast, rid).keys() == {home}, "the run was split"
    assert ledger.total() == 1


def test_resume_after_partitions_were_added_refuses_instead_of_starting_again(
    fast: Settings, tmp_path: Path, ledger: Ledger, redis_client: redis.Redis
) -> None:
    rid = _moving_run_id(fast)
    home = partition_for(rid, fast.partitions)
    first = start_worker(fast, tmp_path, "first", "--run-id", rid, "--charge-mode", "block-after")
    first.wait_flag("effect")
    first.kill()
    before = _partitions_holding(fast, rid)
    _grow(fast)
    # Redis also lost the start index: the worst case, nothing but the hash to go on.
    redis_client.delete(start_key(fast.redis_key_prefix, "default", rid))

    second = start_worker(fast, tmp_path, "second", "--run-id", rid, "--wait-s", "5")
    code, result = second.finish()
    assert code == 1, f"a resume on a grown topic must fail, got {code}: {result}"
    assert "RUNLOG_PARTITIONS" in result["_stderr"] and "ConfigError" in result["_stderr"]
    assert ledger.total() == 1, "the charge ran again"
    assert _partitions_holding(fast, rid) == before == {home: before[home]}, "a second start"

    # Every reader refuses the same way, and a fresh run cannot start on the grown topic.
    with LogReader(fast) as reader, pytest.raises(ConfigError, match="RUNLOG_PARTITIONS"):
        reader.partition_of(rid)
    fresh = fast.model_copy(update={"redis_key_prefix": fast.redis_key_prefix + "-fresh"})
    with services_for(fresh), pytest.raises(ConfigError, match="RUNLOG_PARTITIONS"):
        runlog.open_run(settings=fresh)

    # The log the first worker left is still a sound prefix in the run's own partition.
    with LogReader(fast.model_copy(update={"partitions": GROWN})) as reader:
        events = [r.event for r in reader.read(rid, partition=home, start=0)]
    assert_log_sound(events)
