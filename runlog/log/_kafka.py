"""Kafka access every reader shares: consumer configurations, metadata, watermarks, retries.

One configuration per purpose, named for it: ``reader_config`` for a short-lived reader of
one run's records (replay, the writer's read-back, verify), ``group_config`` for a
long-lived member of a consumer group (projection services). Both read only committed
records and never commit offsets to Kafka: each reader keeps its position with its effects.
"""

from __future__ import annotations

import logging
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from runlog._settings import Settings
from runlog.errors import KafkaUnavailable

KAFKA_LOG = logging.getLogger("runlog.kafka")
"""Where librdkafka's own log lines go (each client's ``logger``): Python logging, never
straight to stderr; runlog reports what a failure means in its own errors. An application
shows them by configuring this logger. confluent-kafka hands them over only when the
client is polled, so a call that blocks (a metadata request) shows none until it returns:
for a live view, ``NATIVE_LOG``."""

NATIVE_LOG = False
"""True: clients made from now on print librdkafka's log lines to stderr as they come
(``runlog --verbose``), instead of handing them to ``KAFKA_LOG``."""


def with_logger(conf: dict[str, Any]) -> dict[str, Any]:
    """``conf`` with librdkafka's log routed as ``NATIVE_LOG`` says (a given one is kept)."""
    if not NATIVE_LOG:
        conf.setdefault("logger", KAFKA_LOG)
    return conf


RETRY_FOR_S = 10.0
"""How long a lookup retries a transient broker error before reporting it unavailable."""

# librdkafka reports these as plain error codes (``retriable()`` is False on them), yet
# they pass on their own: a leader moving, metadata not yet propagated after creation.
TRANSIENT = frozenset(
    {
        KafkaError.NOT_LEADER_FOR_PARTITION,
        KafkaError.LEADER_NOT_AVAILABLE,
        KafkaError.UNKNOWN_TOPIC_OR_PART,
        KafkaError.REQUEST_TIMED_OUT,
        KafkaError._TRANSPORT,
        KafkaError._TIMED_OUT,
        KafkaError._ALL_BROKERS_DOWN,
    }
)

T = TypeVar("T")


def retrying(what: str, call: Callable[[], T], *, for_s: float = RETRY_FOR_S) -> T:
    """``call()``, retried with capped backoff while the broker says the error is transient."""
    deadline = time.monotonic() + for_s
    delay = 0.05
    while True:
        try:
            return call()
        except KafkaException as exc:
            err = exc.args[0] if exc.args else None
            retriable = isinstance(err, KafkaError) and (err.retriable() or err.code() in TRANSIENT)
            if not retriable or time.monotonic() + delay > deadline:
                raise KafkaUnavailable(f"{what}: {exc}") from exc
        time.sleep(delay)
        delay = min(delay * 2, 1.0)


def reader_config(settings: Settings, **extra: Any) -> dict[str, Any]:
    """A catch-up reader of one run: its own throwaway group, positions kept by the caller."""
    conf = dict(settings.kafka_common())
    conf.update(
        {
            "group.id": f"runlog-reader-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "auto.offset.reset": "earliest",
            # Catch-up readers: do not pay librdkafka's 500 ms default wait per fetch.
            "fetch.wait.max.ms": 10,
            "enable.partition.eof": True,
            "isolation.level": "read_committed",
        }
    )
    conf.update(extra)
    return with_logger(conf)


def group_config(settings: Settings, group: str, **extra: Any) -> dict[str, Any]:
    """A member of consumer group ``group`` that stores its positions with its effects."""
    # Tunables first, so RUNLOG_KAFKA_EXTRA may override them; then what correctness needs.
    conf: dict[str, Any] = {
        "session.timeout.ms": 10_000,
        "heartbeat.interval.ms": 1_000,
        "max.poll.interval.ms": 300_000,
        "fetch.wait.max.ms": 20,
    }
    conf.update(settings.kafka_common())
    conf.update(
        {
            "group.id": group,
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "auto.offset.reset": "earliest",
            "isolation.level": "read_committed",
        }
    )
    conf.update(extra)
    return with_logger(conf)


def partitions_of(consumer: Consumer, topic: str) -> dict[int, Any]:
    """The topic's partition metadata by id; ``KafkaUnavailable`` if it does not exist."""
    md = retrying(f"metadata of {topic}", lambda: consumer.list_topics(topic, timeout=10))
    tmd = md.topics.get(topic)
    if tmd is None or tmd.error is not None or not tmd.partitions:
        raise KafkaUnavailable(f"topic {topic} not found (run `runlog topics create`)")
    return dict(tmd.partitions)


def high_watermark(consumer: Consumer, topic: str, partition: int) -> int:
    """The partition's high watermark (the offset the next record will get), from the broker."""
    tp = TopicPartition(topic, partition)
    _, high = retrying(
        f"watermarks of {topic}[{partition}]",
        lambda: consumer.get_watermark_offsets(tp, timeout=10, cached=False),
    )
    return int(high)


def unreachable(bootstrap_servers: str, *, timeout: float = 2.0) -> str | None:
    """``None`` if any of the bootstrap servers accepts a TCP connection; else what each
    said (``127.0.0.1:1: connection refused``). A check of the address alone: TLS, SASL and
    the broker's answers are the client's to report."""
    said: list[str] = []
    for server in (s.strip() for s in bootstrap_servers.split(",")):
        if not server:
            continue
        host, _, port = server.split("://", 1)[-1].rpartition(":")
        host = host.strip("[]") or "127.0.0.1"
        try:
            with socket.create_connection((host, int(port)), timeout=timeout):
                return None
        except ValueError:
            said.append(f"{server}: not host:port")
        except OSError as exc:
            said.append(f"{server}: {exc.strerror or type(exc).__name__}")
    return "; ".join(said) if said else "no bootstrap server given"


def live_groups(settings: Settings, prefix: str, *, timeout: float = 5.0) -> dict[str, int]:
    """Consumer groups whose id starts with ``prefix`` and that have members now: id ->
    member count. Asks the broker (the group coordinator); never reads a topic."""
    from confluent_kafka.admin import AdminClient

    admin = AdminClient(settings.kafka_common(), logger=KAFKA_LOG)
    try:
        listed = admin.list_consumer_groups(request_timeout=timeout).result()
        ids = [g.group_id for g in listed.valid if g.group_id.startswith(prefix)]
        if not ids:
            return {}
        described = admin.describe_consumer_groups(ids, request_timeout=timeout)
        out: dict[str, int] = {}
        for gid, fut in described.items():
            members = len(fut.result().members)
            if members:
                out[gid] = members
        return out
    except KafkaException as exc:
        raise KafkaUnavailable(f"consumer groups: {exc}") from exc
