"""What a test stack stores, as bytes, for tests that look for a secret where none may be."""

from __future__ import annotations

import time
import uuid
from typing import Any

from confluent_kafka import Consumer, KafkaError, TopicPartition

from runlog.log.clients import redis_client
from runlog.settings import Settings


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
