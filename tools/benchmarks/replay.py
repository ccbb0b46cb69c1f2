"""3. Replay: how fast a run's log turns back into its state, and what bends the line.

In memory, over pre-encoded records, three stages that each include the previous one:

* ``avro``: fastavro alone with the writer schema named by the fingerprint (the Avro limit);
* ``decode``: ``codec.decode`` (Avro + upcasting + pydantic validation into ``Event``);
* ``fold``: ``codec.decode`` + ``run_state.apply`` (what a replay does).

From Kafka, the same run written with a raw producer into the run's partition:

* ``fetch``: a plain consumer reading the records (no decoding): the broker/client limit;
* ``logreader_fold``: ``LogReader.read`` from the run's first offset + ``apply``: the path
  ``open_run`` takes.

Replay time against run length should be a straight line (time = a + b*n). ``a`` is the
fixed cost of one read; ``b`` the cost per event; the log-log slope says whether the
growth is linear (1.0) or worse. Interleaving: the same run with other runs' records
between its own in the same partition, and with other runs' records after its end.

Kafka run lengths are deliberately not multiples of 500: librdkafka's ``consume(n, t)``
waits the whole timeout unless n records arrive, and ``LogReader`` once asked for 500 with
a 1 s timeout, so any read that did not end on a full batch paid a second.
``batch_boundary`` (a run of 1,000 records against 1,001) keeps that from coming back.
"""

from __future__ import annotations

import io
import time
import uuid
from typing import Any

import fastavro

from runlog._settings import Settings
from runlog.log._kafka import reader_config
from runlog.log._reader import LogReader
from runlog.producers._opening import open_run_with
from runlog.producers._writer import producer_config
from runlog.projections._run_state import RunState, apply
from runlog.schemas import _codec as codec
from runlog.schemas._keys import partition_for
from tools.benchmarks.common import (
    TENANT,
    Encoded,
    Stopwatch,
    encode_all,
    fit_line,
    loglog_slope,
    make_events,
    produce,
    ratios,
    summary,
)

STAGES = ("avro", "decode", "fold")


def _in_memory(values: list[bytes]) -> dict[str, float]:

    out: dict[str, float] = {}
    with Stopwatch() as sw:
        for v in values:
            ws = codec.writer_schema_of(v)
            fastavro.schemaless_reader(io.BytesIO(v[codec.HEADER_LEN :]), ws.parsed)
    out["avro"] = sw.seconds
    with Stopwatch() as sw:
        for v in values:
            codec.decode(v)
    out["decode"] = sw.seconds
    state = RunState()
    with Stopwatch() as sw:
        for v in values:
            apply(state, codec.decode(v))
    out["fold"] = sw.seconds
    if state.seq != len(values):
        raise RuntimeError(f"fold reached seq {state.seq} of {len(values)}: workload invalid")
    return out


def _produce(settings: Settings, partition: int, records: list[Encoded]) -> tuple[int, int]:
    """Write ``records`` to ``partition``; returns (first offset, end offset)."""
    from confluent_kafka import KafkaError, Message, Producer

    producer = Producer(producer_config(settings, {"linger.ms": 5}))
    offsets: list[int] = []
    failures: list[KafkaError] = []

    def on_delivery(err: KafkaError | None, msg: Message) -> None:
        if err is not None:
            failures.append(err)
        else:
            off = msg.offset()
            assert off is not None
            offsets.append(off)

    for rec in records:
        produce(producer, settings.events_topic, rec, partition=partition, on_delivery=on_delivery)
        producer.poll(0)
    if producer.flush(120) or failures:
        raise RuntimeError(f"replay setup: delivery failed {failures[:3]}")
    return min(offsets), max(offsets) + 1


def _fetch(
    settings: Settings, partition: int, start: int, end: int, key: bytes
) -> tuple[float, int]:
    """Plain consumer from ``start`` to ``end``: seconds and records of ``key`` seen."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer(reader_config(settings))
    seen = 0
    try:
        with Stopwatch() as sw:
            consumer.assign([TopicPartition(settings.events_topic, partition, start)])
            done = False
            while not done:
                for msg in consumer.consume(1000, timeout=0.05):
                    off = msg.offset()
                    if msg.error() is not None or off is None:
                        continue
                    if msg.key() == key:
                        seen += 1
                    if off + 1 >= end:
                        done = True
    finally:
        consumer.close()
    return sw.seconds, seen


def _logreader_fold(
    settings: Settings, run_id: str, partition: int, start: int
) -> tuple[float, int]:

    state = RunState()
    with LogReader(settings) as reader:
        reader.partition_count()  # metadata outside the timing, like a reused reader
        with Stopwatch() as sw:
            for rec in reader.read(run_id, partition=partition, start=start):
                apply(state, rec.event)
    return sw.seconds, state.seq


def _partition_of(settings: Settings, run_id: str) -> int:

    return partition_for(run_id, settings.partitions)


def measure(
    settings: Settings,
    *,
    lengths: tuple[int, ...],
    kafka_lengths: tuple[int, ...],
    interleave_len: int,
    others: tuple[int, ...],
    repeats: int,
    deps: Any = None,
) -> dict[str, Any]:
    out: dict[str, Any] = {"in_memory": {}, "kafka": {}, "interleaved": {}}
    # In memory ---------------------------------------------------------------------------
    longest = max(lengths)
    values = [r.value for r in encode_all(make_events(f"bench-replay-{uuid.uuid4().hex}", longest))]
    out["avg_record_bytes"] = sum(len(v) for v in values) / len(values)
    for n in lengths:
        per: dict[str, list[float]] = {s: [] for s in STAGES}
        for _ in range(repeats):
            got = _in_memory(values[:n])
            for s in STAGES:
                per[s].append(got[s])
        out["in_memory"][str(n)] = {
            "events": n,
            **{f"{s}_s": summary(per[s]) for s in STAGES},
            **{f"{s}_events_per_s": summary([n / t for t in per[s]]) for s in STAGES},
            "ratio_fold_over_avro": summary(ratios(per["fold"], per["avro"])),
            "ratio_fold_over_decode": summary(ratios(per["fold"], per["decode"])),
        }
    medians = {s: [out["in_memory"][str(n)][f"{s}_s"]["median"] for n in lengths] for s in STAGES}
    out["in_memory_model"] = {
        s: {
            "per_event_us": fit_line(list(map(float, lengths)), medians[s])[1] * 1e6,
            "loglog_slope": loglog_slope(list(map(float, lengths)), medians[s]),
        }
        for s in STAGES
    }
    # From Kafka --------------------------------------------------------------------------
    for n in kafka_lengths:
        run_id = f"bench-replay-{uuid.uuid4().hex}"
        part = _partition_of(settings, run_id)
        start, end = _produce(settings, part, encode_all(make_events(run_id, n)))
        fetch: list[float] = []
        fold: list[float] = []
        for _ in range(repeats):
            t_fetch, seen = _fetch(settings, part, start, end, run_id.encode())
            t_fold, seq = _logreader_fold(settings, run_id, part, start)
            if seen != n or seq != n:
                raise RuntimeError(f"replay of {n}: fetched {seen}, folded to seq {seq}")
            fetch.append(t_fetch)
            fold.append(t_fold)
        out["kafka"][str(n)] = {
            "events": n,
            "fetch_s": summary(fetch),
            "logreader_fold_s": summary(fold),
            "fetch_events_per_s": summary([n / t for t in fetch]),
            "logreader_fold_events_per_s": summary([n / t for t in fold]),
            "ratio_logreader_fold_over_fetch": summary(ratios(fold, fetch)),
        }
    ks = [float(n) for n in kafka_lengths]
    for name in ("fetch", "logreader_fold"):
        ys = [out["kafka"][str(n)][f"{name}_s"]["median"] for n in kafka_lengths]
        a, b = fit_line(ks, ys)
        out.setdefault("kafka_model", {})[name] = {"fixed_s": a, "per_event_us": b * 1e6}
    # The reader's batch boundary: a run of exactly k*500 records vs one more. Before
    # 05b1912 the second paid a whole 1 s consume() timeout; kept as a regression check.
    for n in (1_000, 1_001):
        run_id = f"bench-replay-{uuid.uuid4().hex}"
        part = _partition_of(settings, run_id)
        start, _ = _produce(settings, part, encode_all(make_events(run_id, n)))
        boundary = [_logreader_fold(settings, run_id, part, start)[0] for _ in range(repeats)]
        out.setdefault("batch_boundary", {})[str(n)] = summary(boundary)
    # Interleaved with other runs in the same partition ------------------------------------
    n = interleave_len
    for m in (0, *others):
        for layout in ("interleaved", "after") if m else ("alone",):
            run_id = f"bench-replay-{uuid.uuid4().hex}"
            part = _partition_of(settings, run_id)
            mine = encode_all(make_events(run_id, n))
            theirs = [
                encode_all(make_events(f"bench-other-{uuid.uuid4().hex}", n)) for _ in range(m)
            ]
            if layout == "after":
                records = mine + [rec for other in theirs for rec in other]
            else:
                records = [rec for i in range(n) for rec in (mine[i], *(o[i] for o in theirs))]
            start, end = _produce(settings, part, records)
            times: list[float] = []
            for _ in range(repeats):
                t, seq = _logreader_fold(settings, run_id, part, start)
                if seq != n:
                    raise RuntimeError(f"interleaved replay folded to seq {seq} of {n}")
                times.append(t)
            out["interleaved"][f"{layout}:{m}"] = {
                "layout": layout,
                "other_runs": m,
                "run_events": n,
                "records_scanned": end - start,
                "logreader_fold_s": summary(times),
                "run_events_per_s": summary([n / t for t in times]),
            }
    if deps is not None:
        out["open_new_run_after_traffic"] = _open_after_traffic(deps, settings, repeats)
    return out


def _open_after_traffic(deps: Any, settings: Settings, repeats: int) -> dict[str, Any]:
    """``open_run`` of a new run right after this section filled the topic.

    A new run has no events, but its open looks for them from the run id's time minus a
    60 s clock-skew margin to the end of its partition: it reads every record written
    there in the last minute.
    """
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer(reader_config(settings))
    try:
        total = sum(
            consumer.get_watermark_offsets(TopicPartition(settings.events_topic, p), timeout=10)[1]
            for p in range(settings.partitions)
        )
    finally:
        consumer.close()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        open_run_with(deps, None, tenant=TENANT, recover=False).close()
        times.append(time.perf_counter() - t0)
    return {"records_in_topic": total, "open_s": summary(times)}
