"""One Kafka producer shared by every run in a process, with a future per append.

Many runs pipeline through one idempotent producer, so throughput grows with
concurrency; each append still gets its own acknowledgement (a future resolved by the
delivery report), which is what a durability barrier waits on.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from runlog.errors import KafkaUnavailable
from runlog.settings import Settings

log = logging.getLogger(__name__)


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
        # A fatal producer error (e.g. the principal may not write: "Cluster authorization
        # failed" on the idempotent PID) purges every queued append with a bare "Purged in
        # queue"; kept here so those appends fail with the reason instead.
        self._fatal: KafkaError | None = None
        self._closed = threading.Event()
        self._poller = threading.Thread(target=self._poll_loop, name="runlog-writer", daemon=True)
        self._poller.start()

    def _poll_loop(self) -> None:
        while not self._closed.is_set():
            try:
                self._producer.poll(0.05)
            except KafkaException as exc:
                err = exc.args[0] if exc.args else None
                if isinstance(err, KafkaError) and err.fatal():
                    if self._fatal is None:
                        log.error("producer failed for good: %s", err.str())
                    self._fatal = err
                    continue
                log.exception("delivery callback failed")
            except Exception:  # a callback error must not kill the poller
                log.exception("delivery callback failed")

    def send(
        self,
        topic: str,
        key: bytes,
        value: bytes,
        headers: list[tuple[str, str | bytes | None]],
    ) -> Future[Delivered]:
        fut: Future[Delivered] = Future()

        def on_delivery(err: KafkaError | None, msg: Message) -> None:
            if err is not None:
                purged = err.code() in (KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT)
                fatal = self._fatal if purged and self._fatal is not None else None
                fut.set_exception(DeliveryFailed(fatal or err))
            else:
                part, off = msg.partition(), msg.offset()
                assert part is not None and off is not None  # set on every delivered message
                fut.set_result(Delivered(part, off, msg.timestamp()[1]))

        while True:
            try:
                self._producer.produce(
                    topic, value=value, key=key, headers=headers, on_delivery=on_delivery
                )
                return fut
            except BufferError:
                # Local queue full: let deliveries drain, then try again.
                self._producer.poll(0.05)
            except KafkaException as exc:
                raise KafkaUnavailable(f"produce to {topic} failed: {exc}") from exc

    def flush(self, timeout: float = 30.0) -> int:
        return int(self._producer.flush(timeout))

    def close(self, timeout: float = 30.0) -> None:
        try:
            self.flush(timeout)
        finally:
            self._closed.set()
            self._poller.join(timeout=2)
