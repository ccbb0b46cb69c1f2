"""Shared pieces of the benchmarks: statistics, the machine, the workload, scratch topics.

Every figure is a list of per-repeat values summarised as min / median / max; ratios are
computed inside one repeat (both sides measured back to back on the same noisy machine)
and only then summarised.
"""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from typing import Any

from runlog import stack
from runlog._settings import Settings
from runlog._topics import ensure_topics, topic_specs
from runlog.log._clients import redis_client
from runlog.log._kafka import reader_config
from runlog.producers._opening import open_run_with
from runlog.producers._writer import producer_config
from runlog.schemas import _codec as codec
from runlog.schemas._vocabulary import EventType
from tools import child_env

TENANT = "bench"


# ----------------------------------------------------------------------------- statistics


def summary(values: Sequence[float]) -> dict[str, Any]:
    """min / median / max of per-repeat values (and the values themselves)."""
    vals = [float(v) for v in values]
    if not vals:
        raise ValueError("no values to summarise")
    return {
        "min": min(vals),
        "median": statistics.median(vals),
        "max": max(vals),
        "values": vals,
    }


def percentile(samples: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100) of ``samples``."""
    ordered = sorted(samples)
    if not ordered:
        raise ValueError("no samples")
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def ratios(numer: Sequence[float], denom: Sequence[float]) -> list[float]:
    """Element-wise ratios of two per-repeat series measured in the same repeats."""
    return [a / b for a, b in zip(numer, denom, strict=True) if b > 0]


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least squares ``y = a + b*x``; returns ``(a, b)``."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    return my - b * mx, b


def loglog_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Exponent k of ``y ~ x**k``: 1.0 is linear, 2.0 quadratic."""
    import math

    _, b = fit_line([math.log(x) for x in xs], [math.log(max(y, 1e-12)) for y in ys])
    return b


class Stopwatch:
    """``with Stopwatch() as sw: ...; sw.seconds``."""

    def __init__(self) -> None:
        self.start = 0.0
        self.seconds = 0.0

    def __enter__(self) -> Stopwatch:
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.start


# ------------------------------------------------------------------------------ the machine


def _first_line_with(path: str, prefix: str) -> str | None:
    with contextlib.suppress(OSError), open(path, encoding="utf-8") as fh:
        for line in fh:
            if line.startswith(prefix):
                return line.split(":", 1)[1].strip()
    return None


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def redis_version(settings: Settings) -> str | None:

    client = redis_client(settings)
    try:
        info: dict[str, Any] = client.info("server")
        return str(info.get("redis_version"))
    except Exception:  # noqa: BLE001 - only descriptive; the benchmark itself will fail loudly
        return None
    finally:
        client.close()


def machine(settings: Settings) -> dict[str, Any]:
    """What the numbers were measured on: always printed next to them."""
    import confluent_kafka

    mem_kb = _first_line_with("/proc/meminfo", "MemTotal")
    try:
        load = list(os.getloadavg())
    except OSError:
        load = []
    return {
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "cpu_model": _first_line_with("/proc/cpuinfo", "model name") or platform.processor(),
        "cores": os.cpu_count(),
        "memory_gib": round(int(mem_kb.split()[0]) / 1024**2, 1) if mem_kb else None,
        "load_avg_at_start": [round(x, 2) for x in load],
        "kernel": platform.release(),
        "python": sys.version.split()[0],
        "kafka_broker": f"{stack.KAFKA_VERSION} (embedded stack, 1 KRaft node)",
        "confluent_kafka": confluent_kafka.version()[0],
        "librdkafka": confluent_kafka.libversion()[0],
        "fastavro": _version("fastavro"),
        "pydantic": _version("pydantic"),
        "redis_server": redis_version(settings),
        "redis_py": _version("redis"),
    }


def settings_summary(settings: Settings) -> dict[str, Any]:

    conf = producer_config(settings)
    return {
        "bootstrap_servers": settings.bootstrap_servers,
        "redis_url": settings.redis_url,
        "events_topic": settings.events_topic,
        "partitions": settings.partitions,
        "replication_factor": settings.replication_factor,
        "lease_ttl_ms": settings.lease_ttl_ms,
        "producer": {
            k: conf[k]
            for k in (
                "acks",
                "enable.idempotence",
                "linger.ms",
                "max.in.flight.requests.per.connection",
            )
        },
    }


# ------------------------------------------------------------------------------ the workload

USER_TEXT = "Please reconcile invoice 4711 against the ledger and flag any mismatch. " * 3
MODEL_TEXT = "I will look up the invoice, then compare each line with the ledger entries. " * 5
TOOL_RESULT = '{"invoice": 4711, "lines": 12, "total": "1024.50", "status": "open"} ' * 4


def workload_payload(seq: int) -> tuple[Any, dict[str, Any]]:
    """Type and payload of the event at ``seq`` (>= 2) of a benchmark run.

    A four-event cycle of an agent loop: user message, model turn proposing one call, the
    call's STARTED, its COMPLETED (``started_seq`` is always the previous seq). About
    300-500 bytes each once encoded. Call ids and keys are unique per seq.
    """

    k = (seq - 2) % 4
    call = f"c{seq - k + 1}"
    key = f"k{seq - k + 1:030d}"[-32:]
    args = '{"invoice":4711}'
    if k == 0:
        return EventType.USER_MESSAGE, {"content": USER_TEXT}
    if k == 1:
        return EventType.MODEL_TURN, {
            "text": MODEL_TEXT,
            "tool_calls": [
                {"call_id": call, "name": "ledger", "args_json": args, "idempotency_key": key}
            ],
            "usage": {"input_tokens": 1200, "output_tokens": 180},
            "cost_usd": 0.0031,
        }
    if k == 2:
        return EventType.TOOL_CALL_STARTED, {
            "call_id": call,
            "name": "ledger",
            "args_json": args,
            "idempotency_key": key,
            "attempt": 1,
            "risk": "safe",
        }
    return EventType.TOOL_CALL_COMPLETED, {
        "call_id": call,
        "name": "ledger",
        "started_seq": seq - 1,
        "content": TOOL_RESULT,
        "idempotency_key": key,
        "source": "live",
    }


def timed_appends(deps: Any, n: int) -> list[float]:
    """``Run.append`` of ``n`` workload events to a new run: seconds each, to its ack."""
    samples: list[float] = []
    with open_run_with(deps, None, tenant=TENANT, recover=False) as run:
        for _ in range(n):
            et, payload = workload_payload(run.state.seq + 1)
            t0 = time.perf_counter()
            run.append(et, payload)
            samples.append(time.perf_counter() - t0)
    return samples


def make_events(run_id: str, n: int, *, epoch: int = 1) -> list[Any]:
    """A valid run of ``n`` events (RUN_STARTED, then the workload), as ``Event`` objects."""

    out: list[Any] = []
    writer = f"bench:{os.getpid()}"
    for seq in range(1, n + 1):
        if seq == 1:
            et, payload = EventType.RUN_STARTED, {"agent": "bench", "goal": "measure"}
        else:
            et, payload = workload_payload(seq)
        out.append(
            codec.build_event(
                et, payload, run_id=run_id, tenant=TENANT, seq=seq, epoch=epoch, writer_id=writer
            )
        )
    return out


@dataclass(frozen=True)
class Encoded:
    """One pre-encoded record: what runlog would hand to the producer."""

    key: bytes
    value: bytes
    headers: list[tuple[str, str | bytes | None]]


def warm_producer(
    settings: Settings, records: Sequence[Encoded], overrides: dict[str, Any] | None = None
) -> Any:
    """A plain producer with runlog's own config (and ``overrides``), its connection and
    producer id set up by one warm-up record: runlog's writer is warm too, so a baseline
    pays neither in its timing."""
    from confluent_kafka import Producer

    producer = Producer(producer_config(settings, overrides))
    producer.produce(settings.events_topic, value=records[0].value, key=b"bench-warmup")
    producer.flush(30)
    return producer


def produce(producer: Any, topic: str, rec: Encoded, **kw: Any) -> None:
    """Send ``rec`` (``kw``: partition, on_delivery), waiting for room while the producer's
    local queue is full."""
    while True:
        try:
            producer.produce(topic, value=rec.value, key=rec.key, headers=rec.headers, **kw)
            return
        except BufferError:
            producer.poll(0.05)


def encode_all(events: Sequence[Any]) -> list[Encoded]:

    return [Encoded(e.run_id.encode(), codec.encode(e), codec.headers(e)) for e in events]


# --------------------------------------------------------------------------- scratch topics


@dataclass
class Scratch:
    """Benchmark topics and Redis keys under a unique prefix; removed by ``cleanup``."""

    settings: Settings
    created: list[str] = field(default_factory=list)

    @classmethod
    def create(cls, base: Settings, **update: Any) -> Scratch:

        prefix = f"{base.topic_prefix}-bench-{uuid.uuid4().hex[:8]}"
        s = base.model_copy(update={"topic_prefix": prefix, "redis_key_prefix": prefix, **update})
        ensure_topics(s).raise_for_drift()
        scratch = cls(s, [spec.name for spec in topic_specs(s)])
        scratch.wait_ready()
        return scratch

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Until every partition answers a watermark query.

        Right after creation the metadata may name a leader that still answers
        NOT_LEADER_FOR_PARTITION; a benchmark must not measure that.
        """
        from confluent_kafka import Consumer, KafkaException, TopicPartition

        consumer = Consumer(reader_config(self.settings))
        deadline = time.monotonic() + timeout
        try:
            for p in range(self.settings.partitions):
                while True:
                    try:
                        consumer.get_watermark_offsets(
                            TopicPartition(self.settings.events_topic, p), timeout=5, cached=False
                        )
                        break
                    except KafkaException:
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(0.2)
        finally:
            consumer.close()

    def cleanup(self) -> None:
        """Best effort: a leftover scratch topic costs disk, not correctness."""
        from confluent_kafka.admin import AdminClient

        with contextlib.suppress(Exception):
            futures = AdminClient(self.settings.kafka_common()).delete_topics(
                self.created, operation_timeout=30
            )
            for fut in futures.values():
                fut.result(timeout=30)
        client = redis_client(self.settings)
        try:
            keys = list(client.scan_iter(match=f"{self.settings.redis_key_prefix}:*", count=1000))
            for i in range(0, len(keys), 500):
                client.delete(*keys[i : i + 500])
        except Exception:  # noqa: BLE001 - best effort, like the topics
            pass
        finally:
            client.close()


def worker_env(settings: Settings, **extra: str) -> dict[str, str]:
    """Environment for a benchmark subprocess: the same stack, topics and key prefix."""
    env = child_env()
    env.update(settings.as_env())
    env["RUNLOG_REDIS_KEY_PREFIX"] = settings.redis_key_prefix
    env["RUNLOG_DELIVERY_TIMEOUT_MS"] = str(settings.delivery_timeout_ms)
    env.update(extra)
    return env
