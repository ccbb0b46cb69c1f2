"""What a test stack stores, read back raw: the events topic's records, and everything in the
topics and Redis as bytes for tests that look for a secret where none may be."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, KafkaError, Message, TopicPartition

from runlog._settings import Settings
from runlog.log._clients import redis_client
from runlog.log._kafka import partitions_of, reader_config


def partition_records(consumer: Consumer, topic: str, partition: int) -> list[Message]:
    """Every record of one partition, read straight from offset zero to its end as of now."""
    _, high = consumer.get_watermark_offsets(
        TopicPartition(topic, partition), timeout=10, cached=False
    )
    out: list[Message] = []
    if high <= 0:
        return out
    consumer.assign([TopicPartition(topic, partition, 0)])
    pos = 0
    while pos < high:
        for msg in consumer.consume(500, timeout=1.0):
            if msg.error() is None:
                pos = (msg.offset() or 0) + 1
                out.append(msg)
    consumer.unassign()
    return out


def events_records(s: Settings) -> list[Message]:
    """Every record of the events topic, read straight from each partition to its end."""
    consumer = Consumer(reader_config(s))
    try:
        return [
            msg
            for p in sorted(partitions_of(consumer, s.events_topic))
            for msg in partition_records(consumer, s.events_topic, p)
        ]
    finally:
        consumer.close()


def as_bytes(value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


def topic_bytes(s: Settings) -> bytes:
    """Every key, value and header in the events and quarantine topics."""
    consumer = Consumer(
        {
            **s.kafka_common(),
            "group.id": f"secret-scan-{uuid.uuid4().hex}",
            "enable.partition.eof": True,
            "auto.offset.reset": "earliest",
        }
    )
    chunks: list[bytes] = []
    try:
        for topic in (s.events_topic, s.quarantine_topic):
            tps = [TopicPartition(topic, p, 0) for p in range(s.partitions)]
            consumer.assign(tps)
            eof: set[int] = set()
            deadline = time.monotonic() + 30
            while len(eof) < len(tps) and time.monotonic() < deadline:
                for msg in consumer.consume(500, timeout=0.5):
                    err = msg.error()
                    if err is not None:
                        if err.code() == KafkaError._PARTITION_EOF:
                            eof.add(msg.partition() or 0)
                        continue
                    headers: list[Any] = list(msg.headers() or [])
                    chunks += [as_bytes(msg.key() or b""), as_bytes(msg.value() or b"")]
                    chunks += [as_bytes(h[0]) + b"=" + as_bytes(h[1] or b"") for h in headers]
            consumer.unassign()
    finally:
        consumer.close()
    return b"\n".join(chunks)


def redis_bytes(s: Settings) -> bytes:
    """Every key and value in the Redis, whatever its type (strings, hashes, lists...)."""
    c: Any = redis_client(s)  # redis-py's return types are unions of sync and async results
    out: list[bytes] = []
    try:
        for key in c.scan_iter(count=1000):
            out.append(as_bytes(key))
            kind = c.type(key)
            items: list[Any] = []
            if kind == b"string":
                items = [c.get(key)]
            elif kind == b"hash":
                items = [x for kv in c.hgetall(key).items() for x in kv]
            elif kind == b"list":
                items = c.lrange(key, 0, -1)
            elif kind == b"set":
                items = list(c.smembers(key))
            elif kind == b"zset":
                items = c.zrange(key, 0, -1)
            elif kind == b"stream":
                items = [x for _, fields in c.xrange(key) for kv in fields.items() for x in kv]
            out += [as_bytes(x) for x in items]
    finally:
        c.close()
    return b"\n".join(out)


def kafka_dirs() -> list[Path]:
    """The embedded stack's Kafka data (``runlog.stack``: RUNLOG_STACK_DIR, else its default
    state dir), where the segment files of the tests' topics are."""
    from runlog.stack._config import StackConfig

    root = StackConfig.from_env().state_dir / "kafka"
    assert root.is_dir(), f"no Kafka data under {root} (the embedded stack's state dir)"
    return [root]


def on_disk(topic: str, needle: bytes) -> bool:
    """Whether ``needle`` is in any file of ``topic``'s partition directories (a directory
    the broker is deleting meanwhile, another topic's, is passed over)."""
    found_dir = False
    for root in kafka_dirs():
        for parent, dirs, _ in os.walk(root):  # os.walk ignores what vanishes under it
            for name in dirs:
                if not name.startswith(f"{topic}-") or not name[len(topic) + 1 :].isdigit():
                    continue
                found_dir = True
                d = Path(parent) / name
                for f in d.iterdir():
                    if f.is_file() and needle in f.read_bytes():
                        return True
    assert found_dir, f"no partition directory of {topic} on disk"
    return False
