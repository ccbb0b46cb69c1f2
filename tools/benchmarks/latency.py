"""1. Durable append latency: each event acknowledged before the next one is sent.

runlog ``Run.append`` (guard, produce, wait for the ack, Redis ownership re-check) against
what it is built from and what it replaces:

* ``raw_kafka``: a confluent-kafka producer with runlog's own ``producer_config`` (acks=all,
  idempotence, the same linger) sending the same encoded bytes and headers, waiting for
  each delivery report: the physical limit of the Kafka path;
* ``file_fsync``: a JSON line appended to a local file, then ``os.fsync``;
* ``sqlite_full``: one INSERT per event into SQLite in WAL mode with ``synchronous=FULL``
  (autocommit: one transaction, one WAL fsync per event).

Kafka's single embedded node acknowledges from the page cache (no fsync per message) while
the two local stores fsync; docs/performance.md says what each promises.
"""

from __future__ import annotations

import os
import sqlite3
import tempfile
import time
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from runlog._settings import Settings
from tools.benchmarks.common import (
    Encoded,
    encode_all,
    make_events,
    percentile,
    produce,
    ratios,
    summary,
    timed_appends,
    warm_producer,
)

SYSTEMS = ("runlog", "raw_kafka", "file_fsync", "sqlite_full")


def _raw_kafka(settings: Settings, records: list[Encoded]) -> list[float]:
    from confluent_kafka import KafkaError, Message

    done: list[KafkaError | None] = []

    def on_delivery(err: KafkaError | None, _msg: Message) -> None:
        done.append(err)

    samples: list[float] = []
    # The physical floor: one record produced and flushed, no linger, nothing else.
    producer = warm_producer(settings, records, {"linger.ms": "0"})
    try:
        for rec in records:
            done.clear()
            t0 = time.perf_counter()
            produce(producer, settings.events_topic, rec, on_delivery=on_delivery)
            producer.flush(30)
            samples.append(time.perf_counter() - t0)
            if done[0] is not None:
                raise RuntimeError(f"raw producer delivery failed: {done[0]}")
    finally:
        producer.flush(30)
    return samples


def _file_fsync(directory: Path, events: list[Any]) -> list[float]:
    lines = [(e.model_dump_json() + "\n").encode() for e in events]
    path = directory / f"events-{uuid.uuid4().hex[:8]}.jsonl"
    samples: list[float] = []
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for line in lines:
            t0 = time.perf_counter()
            os.write(fd, line)
            os.fsync(fd)
            samples.append(time.perf_counter() - t0)
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    return samples


def _sqlite_full(directory: Path, records: list[Encoded], events: list[Any]) -> list[float]:
    path = directory / f"events-{uuid.uuid4().hex[:8]}.sqlite"
    conn = sqlite3.connect(path, isolation_level=None)  # autocommit: one txn per INSERT
    samples: list[float] = []
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute(
            "CREATE TABLE events (run_id TEXT, seq INTEGER, body BLOB, PRIMARY KEY (run_id, seq))"
        )
        for rec, ev in zip(records, events, strict=True):
            t0 = time.perf_counter()
            conn.execute("INSERT INTO events VALUES (?, ?, ?)", (ev.run_id, ev.seq, rec.value))
            samples.append(time.perf_counter() - t0)
    finally:
        conn.close()
        for suffix in ("", "-wal", "-shm"):
            Path(str(path) + suffix).unlink(missing_ok=True)
    return samples


def measure(deps: Any, settings: Settings, *, n: int, repeats: int) -> dict[str, Any]:
    """p50/p99 per system per repeat; systems rotate order across repeats."""
    per: dict[str, dict[str, list[float]]] = {
        s: {"p50": [], "p99": [], "mean": []} for s in SYSTEMS
    }
    with tempfile.TemporaryDirectory(prefix="runlog-bench-") as tmp:
        directory = Path(tmp)
        for r in range(repeats):
            events = make_events(f"bench-lat-{uuid.uuid4().hex[:12]}", n + 1)[1:]
            records = encode_all(events)
            runs: dict[str, Callable[[], list[float]]] = {
                "runlog": partial(timed_appends, deps, n),
                "raw_kafka": partial(_raw_kafka, settings, records),
                "file_fsync": partial(_file_fsync, directory, events),
                "sqlite_full": partial(_sqlite_full, directory, records, events),
            }
            order = SYSTEMS[r % len(SYSTEMS) :] + SYSTEMS[: r % len(SYSTEMS)]
            for name in order:
                samples = runs[name]()
                per[name]["p50"].append(percentile(samples, 50) * 1000)
                per[name]["p99"].append(percentile(samples, 99) * 1000)
                per[name]["mean"].append(sum(samples) / len(samples) * 1000)
        fs_dir = str(directory)
    out: dict[str, Any] = {
        "appends_per_repeat": n,
        "local_store_dir": fs_dir,
        "systems": {
            name: {
                "p50_ms": summary(v["p50"]),
                "p99_ms": summary(v["p99"]),
                "mean_ms": summary(v["mean"]),
            }
            for name, v in per.items()
        },
        "ratio_runlog_over_raw_kafka": {
            "p50": summary(ratios(per["runlog"]["p50"], per["raw_kafka"]["p50"])),
            "p99": summary(ratios(per["runlog"]["p99"], per["raw_kafka"]["p99"])),
        },
    }
    return out
