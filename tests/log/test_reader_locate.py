"""Locating a run never concludes "new" from a look-up that found nothing.

A run id shaped like a minted one (``r`` + 28 hex digits) carries a creation time that
readers use to seek with ``offsets_for_times``. A caller may choose such an id itself (a
job system deriving ids from its own hex), and then the "time" can be anything: for most
such ids it lies far in the future. If Redis has lost the run's keys (restarted without
data, which the README says effects do not depend on), the start index is gone and only
the id's time is left. Before the fix the reader then seeked to the high watermark, saw
no history, and ``open_run`` started the run a second time: an irreversible tool ran
twice while ``runlog verify`` said OK.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

import pytest
import redis
from codec_support import make_event
from confluent_kafka import Producer
from workers.common import assert_log_sound, read_log

import runlog
from runlog._settings import Settings
from runlog.consumers._verify import verify_run
from runlog.log._reader import START_SKEW_MS, LogReader
from runlog.schemas import _codec as codec
from runlog.schemas._keys import partition_for, run_id_time_ms, start_key
from runlog.schemas._vocabulary import EventType

pytestmark = pytest.mark.timeout(90)


def _future_id() -> str:
    """``r`` + 28 hex digits whose embedded time lies centuries ahead (15 ids in 16 do)."""
    rid = "rf" + secrets.token_hex(14)[:27]
    created = run_id_time_ms(rid)
    assert created is not None and created > time.time() * 1000 + 86_400_000
    return rid


def _forget_run(client: redis.Redis, settings: Settings, run_id: str) -> int:
    """Delete every Redis key of the run: Redis restarted without its data."""
    keys = [k for k in client.scan_iter(match=f"{settings.redis_key_prefix}*", count=1000)]
    mine = [k for k in keys if run_id.encode() in k]
    assert mine, "the run should have Redis keys to lose"
    client.delete(*mine)
    return len(mine)


def test_a_future_shaped_caller_id_is_found_after_redis_lost_its_keys(
    fast: Settings, redis_client: redis.Redis
) -> None:
    invoked: list[str] = []

    def effect(args: dict[str, Any], *, idempotency_key: str) -> str:
        invoked.append(idempotency_key)
        return f"charged {args['amount']}"

    charge = runlog.tool("charge", risk="irreversible")(effect)
    rid = _future_id()
    with runlog.open_run(rid, settings=fast, tools=[charge]) as run:
        first = run.call_tool("charge", {"amount": 5}, operation_id="order-1")
    assert invoked and first == "charged 5"

    _forget_run(redis_client, fast, rid)

    with runlog.open_run(rid, settings=fast, tools=[charge]) as again:
        assert again.state.status == "running"
        assert again.state.seq > 1, "the resumed run should see its history"
        second = again.call_tool("charge", {"amount": 5}, operation_id="order-1")
    assert second == first, "the recorded result should be returned"
    assert len(invoked) == 1, "the irreversible tool ran twice"

    events = [r.event for r in read_log(fast, rid)]
    started = [ev for ev in events if ev.type is EventType.RUN_STARTED]
    assert len(started) == 1, "the run was started twice"
    assert_log_sound(events)
    report = verify_run(fast, redis_client, rid)
    assert report.ok, report.text()


def test_an_empty_time_lookup_starts_at_the_partition_beginning(fast: Settings) -> None:
    """The shared locate mechanism: a future time or an empty look-up never means "no
    history"; the reader starts where the partition begins, not at its high watermark."""
    rid = _future_id()
    with runlog.open_run(rid, settings=fast) as run:
        run.append(EventType.USER_MESSAGE, {"content": "hello"})
    with LogReader(fast) as reader:
        part = reader.partition_of(rid)
        assert reader.high_watermark(part) > 0
        start = reader.start_offset(rid, part)
        assert start < reader.high_watermark(part)
        assert [r.event.type for r in reader.read(rid)][:2] == [
            EventType.RUN_STARTED,
            EventType.USER_MESSAGE,
        ]


def test_a_minted_id_from_a_clock_ahead_is_found_from_its_records(
    test_settings: Settings, redis_client: redis.Redis
) -> None:
    """A minted id whose clock ran ahead of the clock that stamped the run's records: the
    id's time lies after the run's first record, so a time look-up lands past it. Its
    records are still found (no RUN_STARTED skipped), and a resume appends RUN_RESUMED."""
    ahead_ms = int(time.time() * 1000) + 10 * START_SKEW_MS
    rid = f"r{ahead_ms:012x}{secrets.token_hex(8)}"
    assert run_id_time_ms(rid) == ahead_ms
    s = test_settings
    started = make_event(EventType.RUN_STARTED, {"agent": "", "goal": ""}, run_id=rid, seq=1)
    said = make_event(EventType.USER_MESSAGE, {"content": "hi"}, run_id=rid, seq=2)
    producer = Producer(s.kafka_common())
    part = partition_for(rid, s.partitions)
    for ev in (started, said):
        producer.produce(s.events_topic, codec.encode(ev), key=rid.encode(), partition=part)
    producer.flush(10)
    with runlog.open_run(rid, tenant="t", settings=s) as run:
        assert run.state.seq == 3  # RUN_STARTED, USER_MESSAGE, then our RUN_RESUMED
    events = [r.event for r in read_log(s, rid)]
    assert [ev.type for ev in events] == [
        EventType.RUN_STARTED,
        EventType.USER_MESSAGE,
        EventType.RUN_RESUMED,
    ]


@pytest.mark.parametrize("tail", [False, True], ids=["nothing-after", "tail-after"])
def test_an_id_time_after_the_runs_first_records_is_read_from_the_beginning(
    tail: bool, test_settings: Settings
) -> None:
    """The id's time lies in the past but after the run's first records (a caller id that
    was in the future when the run began; a clock ahead of the one that stamped the
    records). The time look-up lands after them: on nothing of the run, or on a record the
    fold rejects as a start. Either way the run is read from the partition's beginning."""
    s = test_settings
    now_ms = int(time.time() * 1000)
    rid = f"r{now_ms - 10 * START_SKEW_MS:012x}{secrets.token_hex(8)}"
    part = partition_for(rid, s.partitions)
    early = now_ms - 60 * START_SKEW_MS  # the run's first records: an hour ago
    records = [
        (
            rid,
            early,
            make_event(EventType.RUN_STARTED, {"agent": "", "goal": ""}, run_id=rid, seq=1),
        ),
        (rid, early, make_event(EventType.USER_MESSAGE, {"content": "a"}, run_id=rid, seq=2)),
    ]
    # Another run's record, stamped now: the time look-up finds an offset, after ours.
    other = "job-other"
    if tail:
        records.append(
            (rid, now_ms, make_event(EventType.USER_MESSAGE, {"content": "b"}, run_id=rid, seq=3))
        )
    producer = Producer(s.kafka_common())
    for key, ts, ev in records:
        producer.produce(
            s.events_topic, codec.encode(ev), key=key.encode(), partition=part, timestamp=ts
        )
    filler = make_event(EventType.RUN_STARTED, {"agent": "", "goal": ""}, run_id=other, seq=1)
    producer.produce(
        s.events_topic, codec.encode(filler), key=other.encode(), partition=part, timestamp=now_ms
    )
    assert producer.flush(10) == 0
    with LogReader(s) as reader:
        located = reader.start_offset(rid, part)
        assert located >= 2, "the look-up should land after the run's first records"

    with runlog.open_run(rid, tenant="t", settings=s) as run:
        assert run.state.seq == len(records) + 1  # its history, then our RUN_RESUMED
    events = [r.event for r in read_log(s, rid)]
    assert [ev.type for ev in events].count(EventType.RUN_STARTED) == 1
    assert events[-1].type is EventType.RUN_RESUMED


def test_verify_fails_a_run_started_twice(
    test_settings: Settings, redis_client: redis.Redis
) -> None:
    """A run started a second time by a writer that saw none of its history (Redis lost
    its keys: the epoch counts from 1 again, and the start index now names the second
    RUN_STARTED). Verify reads the whole log, not from that index, and fails the run."""
    s = test_settings
    rid = f"job-{secrets.token_hex(4)}"
    first = [
        make_event(EventType.RUN_STARTED, {"agent": "", "goal": ""}, run_id=rid, seq=1),
        make_event(EventType.USER_MESSAGE, {"content": "one"}, run_id=rid, seq=2),
    ]
    second = [
        make_event(EventType.RUN_STARTED, {"agent": "", "goal": ""}, run_id=rid, seq=1),
        make_event(EventType.USER_MESSAGE, {"content": "two"}, run_id=rid, seq=2),
    ]
    producer = Producer(s.kafka_common())
    part = partition_for(rid, s.partitions)
    for ev in first + second:
        producer.produce(s.events_topic, codec.encode(ev), key=rid.encode(), partition=part)
    assert producer.flush(10) == 0
    offsets = [r.offset for r in read_log(s, rid)]
    assert len(offsets) == 4
    redis_client.set(start_key(s.redis_key_prefix, "t", rid), f"{part}:{offsets[2]}")

    report = verify_run(s, redis_client, rid, tenant="t")
    assert not report.ok, report.text()
    assert report.records == 4
    (once,) = [c for c in report.checks if c.name == "started_once"]
    assert not once.ok and once.counts == {"run_started": 2}, report.text()


def test_verify_passes_a_start_that_lost_a_takeover_race(
    test_settings: Settings, redis_client: redis.Redis
) -> None:
    """A writer took the lease at epoch 1 and appended RUN_STARTED; before that record
    landed, a supervisor took the run over (epoch 2), saw no history and started it. The
    epoch-1 start lands after the epoch-2 one: a stale writer fenced by the takeover, as
    the fold says, not a second start of a run with history (found by the fault explorer,
    seed 4 of 40 steps). Verify passes it; the same start at the winner's epoch (a writer
    that counted epochs from 1 again) still fails ``test_verify_fails_a_run_started_twice``.
    """
    s = test_settings
    rid = f"job-{secrets.token_hex(4)}"
    records = [
        make_event(EventType.RUN_STARTED, {"agent": "", "goal": ""}, run_id=rid, seq=1, epoch=2),
        make_event(EventType.USER_MESSAGE, {"content": "one"}, run_id=rid, seq=2, epoch=2),
        make_event(EventType.RUN_STARTED, {"agent": "", "goal": ""}, run_id=rid, seq=1, epoch=1),
        make_event(EventType.RUN_FINISHED, {"outcome": "ok"}, run_id=rid, seq=3, epoch=2),
    ]
    producer = Producer(s.kafka_common())
    part = partition_for(rid, s.partitions)
    for ev in records:
        producer.produce(s.events_topic, codec.encode(ev), key=rid.encode(), partition=part)
    assert producer.flush(10) == 0

    report = verify_run(s, redis_client, rid, tenant="t")
    assert report.ok, report.text()
    (once,) = [c for c in report.checks if c.name == "started_once"]
    assert once.counts == {"run_started": 2}, report.text()
