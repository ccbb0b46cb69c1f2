"""One Kafka producer shared by every run in a process, with a future per append.

Many runs pipeline through one idempotent producer, so throughput grows with
concurrency; each append still gets its own acknowledgement (a future resolved by the
delivery report), which is what a durability barrier waits on.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from runlog.errors import KafkaUnavailable
from runlog.settings import Settings

log = logging.getLogger(__name__)

APPENDS: dict[str, float] = dict.fromkeys(("acknowledged", "failed", "unknown", "ack_seconds"), 0)
"""Process-wide append telemetry (never semantic events): ``acknowledged``, ``failed``
(the broker refused), ``unknown`` (may still be written), and ``ack_seconds`` (their sum,
from produce to acknowledgement). Written by the delivery callback only."""


@dataclass(frozen=True)
class Delivered:
    partition: int
    offset: int
    timestamp_ms: int


class DeliveryFailed(Exception):
    """The broker did not acknowledge an append; ``unknown`` when it may still be written."""

    def __init__(self, error: KafkaError) -> None:
        super().__init__(str(error))
        self.error = error
        # A timeout or a transport error after sending leaves the outcome unknown.
        self.unknown = (
            error.code()
            in (
                KafkaError._MSG_TIMED_OUT,
                KafkaError._TIMED_OUT,
                KafkaError._TRANSPORT,
                KafkaError.REQUEST_TIMED_OUT,
                KafkaError.NOT_ENOUGH_REPLICAS_AFTER_APPEND,
            )
            or error.retriable()
        )


def producer_config(settings: Settings, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Durable producer settings: idempotence and acks=all are not librdkafka's defaults."""
    conf = dict(settings.kafka_common())
    conf.update(
        {
            "enable.idempotence": True,
            "acks": "all",
            # Java's partitioner, so every client agrees where a run lives.
            "partitioner": "murmur2_random",
            "linger.ms": 1,
            "delivery.timeout.ms": settings.delivery_timeout_ms,
            "max.in.flight.requests.per.connection": 5,
        }
    )
    conf.update(extra or {})
    return conf


class EventWriter:
    """Thread-safe; ``send`` returns a future of ``Delivered``."""

    def __init__(self, settings: Settings, *, extra: dict[str, Any] | None = None) -> None:
        self.settings = settings
        self._producer = Producer(producer_config(settings, extra))
        self._partitions: dict[str, int] = {}
        self._closed = threading.Event()
        self._poller = threading.Thread(target=self._poll_loop, name="runlog-writer", daemon=True)
        self._poller.start()

    def _poll_loop(self) -> None:
        while not self._closed.is_set():
            try:
                self._producer.poll(0.05)
            except Exception:  # a callback error must not kill the poller
                log.exception("delivery callback failed")

    def send(
        self,
        topic: str,
        key: bytes,
        value: bytes,
        headers: list[tuple[str, str | bytes | None]],
        *,
        partition: int | None = None,
    ) -> Future[Delivered]:
        """Produce to ``partition``; None lets the producer hash ``key`` (tools and tests).

        A run's writer always names the run's partition: the producer hashes over the
        partition count in its latest metadata, which after partitions are added is
        another partition than the run's, and a run split over two partitions has no order.
        """
        where: dict[str, Any] = {} if partition is None else {"partition": partition}
        fut: Future[Delivered] = Future()
        sent = time.monotonic()

        def on_delivery(err: KafkaError | None, msg: Message) -> None:
            if err is not None:
                failed = DeliveryFailed(err)
                APPENDS["unknown" if failed.unknown else "failed"] += 1
                fut.set_exception(failed)
            else:
                APPENDS["acknowledged"] += 1
                APPENDS["ack_seconds"] += time.monotonic() - sent
                part, off = msg.partition(), msg.offset()
                assert part is not None and off is not None  # set on every delivered message
                fut.set_result(Delivered(part, off, msg.timestamp()[1]))

        while True:
            try:
                self._producer.produce(
                    topic,
                    value=value,
                    key=key,
                    headers=headers,
                    on_delivery=on_delivery,
                    **where,
                )
                return fut
            except BufferError:
                # Local queue full: let deliveries drain, then try again.
                self._producer.poll(0.05)
            except KafkaException as exc:
                raise KafkaUnavailable(f"produce to {topic} failed: {exc}") from exc

    def partition_count(self, topic: str) -> int:
        """Partitions of ``topic`` as the broker reported them at this writer's first ask."""
        known = self._partitions.get(topic)
        if known is not None:
            return known
        try:
            md = self._producer.list_topics(topic, timeout=10)
        except KafkaException as exc:
            raise KafkaUnavailable(f"metadata of {topic}: {exc}") from exc
        tmd = md.topics.get(topic)
        if tmd is None or tmd.error is not None or not tmd.partitions:
            raise KafkaUnavailable(f"topic {topic} not found (run `runlog topics create`)")
        self._partitions[topic] = len(tmd.partitions)
        return self._partitions[topic]

    def flush(self, timeout: float = 30.0) -> int:
        return int(self._producer.flush(timeout))

    def close(self, timeout: float = 30.0) -> None:
        try:
            self.flush(timeout)
        finally:
            self._closed.set()
            self._poller.join(timeout=2)
