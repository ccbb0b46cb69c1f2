"""A log tail that follows a partition from its beginning says whether a key has any record.

``LogTail.none_of`` stands in for the read from a partition's beginning that alone may
conclude a run has no history (a fleet worker's open of a requested run), so it must never
say "none" when the log holds a record of the key: not for a key it has read, not while it
is behind the head, and not after the topic was deleted and made again under it.
"""

from __future__ import annotations

import time

import pytest
from confluent_kafka import Producer

from runlog.log.reader import LogReader
from runlog.log.tail import LogTail
from runlog.settings import Settings
from runlog.topics import delete_topics, ensure_topics

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


def test_none_of_answers_only_for_keys_it_has_not_read(test_settings: Settings) -> None:
    s = test_settings
    _write(s, 0, [b"run-a", b"run-b", b"run-a"])
    tail = LogTail(s)
    try:
        tail.follow_whole(0)
        head = _head(s, 0)
        _eventually(lambda: tail.none_of(0, b"run-new", head))
        assert not tail.none_of(0, b"run-a", head)
        assert not tail.none_of(0, b"run-b", head)
        # Behind the head: it cannot say, so it does not say "none".
        assert not tail.none_of(0, b"run-new", head + 5)
        # A partition it does not hold whole: it cannot say either.
        tail.follow(1, 0)
        assert not tail.none_of(1, b"run-new", _head(s, 1))
    finally:
        tail.close()


def test_a_topic_made_again_under_the_tail_leaves_it_answering_nothing(
    test_settings: Settings,
) -> None:
    s = test_settings
    _write(s, 0, [b"other"] * 5)
    tail = LogTail(s)
    try:
        tail.follow_whole(0)
        _eventually(lambda: tail.none_of(0, b"run-x", 5))
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
        # Whether or not the tail has seen the new records yet, it must never answer that
        # run-x has none: the log now holds two.
        end = time.monotonic() + 5
        while time.monotonic() < end:
            assert not tail.none_of(0, b"run-x", 2)
            time.sleep(0.1)
    finally:
        tail.close()
