"""A log tail that follows a partition from its beginning says below which offset a key
has no record.

``LogTail.unseen_below`` stands in for the read from a partition's beginning that alone may
conclude a run has no history (a fleet worker's open of a requested run; its claim reads
the run back from the offset answered), so it must never name an offset with a record of
the key below it: not for a key it has read, and not after the topic was deleted and made
again under it (there it may name an offset above the new log's head, which no claim can
land at or above, and then nothing once it has seen the offsets go back).
"""

from __future__ import annotations

import time

import pytest
from confluent_kafka import Producer

from runlog._settings import Settings
from runlog._topics import delete_topics, ensure_topics
from runlog.log._reader import LogReader
from runlog.log._tail import LogTail

pytestmark = pytest.mark.timeout(120)


def _write(settings: Settings, partition: int, keys: list[bytes]) -> None:
    producer = Producer({**settings.kafka_common(), "acks": "all"})
    for key in keys:
        producer.produce(settings.events_topic, b"not an event", key, partition=partition)
    assert producer.flush(30) == 0


def _head(settings: Settings, partition: int) -> int:
    with LogReader(settings) as reader:
        return reader.high_watermark(partition)


def _eventually(check: object, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, "never became true"
        time.sleep(0.05)


def test_unseen_below_answers_only_for_keys_it_has_not_read(test_settings: Settings) -> None:
    s = test_settings
    _write(s, 0, [b"run-a", b"run-b", b"run-a"])
    tail = LogTail(s)
    try:
        tail.follow_whole(0)
        head = _head(s, 0)
        _eventually(lambda: tail.unseen_below(0, b"run-new") == head)
        assert tail.unseen_below(0, b"run-a") is None
        assert tail.unseen_below(0, b"run-b") is None
        _write(s, 0, [b"run-new"])
        _eventually(lambda: tail.unseen_below(0, b"run-new") is None)
        # Whatever it answers for another key lies at or below the head: what it has read.
        got = tail.unseen_below(0, b"run-other")
        assert got is not None and got <= _head(s, 0)
        # A partition it does not hold whole: it cannot say.
        tail.follow(1, 0)
        assert tail.unseen_below(1, b"run-new") is None
    finally:
        tail.close()
    assert tail.unseen_below(0, b"run-other") is None  # closed: it says nothing


def test_a_topic_made_again_under_the_tail_leaves_it_answering_nothing(
    test_settings: Settings,
) -> None:
    s = test_settings
    _write(s, 0, [b"other"] * 5)
    tail = LogTail(s)
    try:
        tail.follow_whole(0)
        _eventually(lambda: tail.unseen_below(0, b"run-x") == 5)
        delete_topics(s, [s.events_topic])
        deadline = time.monotonic() + 60
        while True:  # the broker finishes a deletion in its own time
            try:
                ensure_topics(s).raise_for_drift()
                _write(s, 0, [b"run-x", b"run-x"])  # offsets 0 and 1, below what it read
                break
            except Exception:  # noqa: BLE001 - "marked for deletion" until the broker is done
                assert time.monotonic() < deadline
                time.sleep(0.5)
        assert _head(s, 0) == 2
        # Whether or not the tail has seen the new records yet, it must never name an
        # offset the new log has reached with run-x below it: until it sees the offsets
        # go back it names its old position (above the head: a claim lands below it and
        # is refused), then nothing.
        end = time.monotonic() + 20
        while (got := tail.unseen_below(0, b"run-x")) is not None:
            assert got > _head(s, 0), f"named {got}, with run-x at 0 and 1"
            assert time.monotonic() < end, "the tail never saw the log go back"
            time.sleep(0.1)
    finally:
        tail.close()
