"""2. Throughput with many concurrent runs sharing one process and one producer.

runlog: R open runs; one thread goes round the runs, each ``Run.emit``-s B events (a
step of an agent loop), then every run's ``barrier()`` waits for its events and re-checks
its lease; repeated until every run has emitted its share. The raw baseline sends the same
number of pre-encoded records (keyed by the same run ids) with one producer and one flush.
The total number of events is the same for every R, so the R-curve isolates concurrency.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from runlog._settings import Settings
from runlog.producers._opening import open_run_with
from tools.benchmarks.common import (
    TENANT,
    Encoded,
    encode_all,
    make_events,
    percentile,
    produce,
    ratios,
    summary,
    warm_producer,
    workload_payload,
)

OPEN_THREADS = 50
"""Runs are opened in parallel: ``open_run`` is dominated by waiting on the broker."""


def open_many(deps: Any, count: int, threads: int = OPEN_THREADS) -> tuple[list[Any], list[float]]:
    """Open ``count`` new runs; returns the runs and each ``open_run`` duration (s)."""

    def one(_: int) -> tuple[Any, float]:
        t0 = time.perf_counter()
        run = open_run_with(deps, None, tenant=TENANT, recover=False)
        return run, time.perf_counter() - t0

    with ThreadPoolExecutor(max_workers=min(threads, count)) as pool:
        got = list(pool.map(one, range(count)))
    return [r for r, _ in got], [d for _, d in got]


def _runlog(deps: Any, runs: list[Any], per_run: int, batch: int) -> float:
    emitted = 0
    t0 = time.perf_counter()
    while emitted < per_run:
        step = min(batch, per_run - emitted)
        for run in runs:
            for _ in range(step):
                et, payload = workload_payload(run.state.seq + 1)
                run.emit(et, payload)
        for run in runs:
            run.barrier()
        emitted += step
    return time.perf_counter() - t0


def _raw(settings: Settings, records: list[Encoded]) -> float:
    from confluent_kafka import KafkaError, Message

    failures: list[KafkaError] = []

    def on_delivery(err: KafkaError | None, _msg: Message) -> None:
        if err is not None:
            failures.append(err)

    producer = warm_producer(settings, records)
    t0 = time.perf_counter()
    for rec in records:
        produce(producer, settings.events_topic, rec, on_delivery=on_delivery)
        producer.poll(0)
    left = producer.flush(60)
    elapsed = time.perf_counter() - t0
    if left or failures:
        raise RuntimeError(f"raw producer: {left} undelivered, failures {failures[:3]}")
    return elapsed


def measure(
    deps: Any,
    settings: Settings,
    *,
    run_counts: tuple[int, ...],
    total_events: int,
    batch: int,
    repeats: int,
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "total_events": total_events,
        "events_per_barrier": batch,
        "open_threads": OPEN_THREADS,
        "by_runs": {},
    }
    open_times: list[float] = []
    for count in run_counts:
        per_run = max(batch, total_events // count)
        events_total = per_run * count
        rl: list[float] = []
        raw: list[float] = []
        for r in range(repeats):
            runs, opened = open_many(deps, count)
            open_times.extend(opened)
            try:
                # The same bytes the runs will write, keyed by the same run ids.
                records: list[Encoded] = []
                for run in runs:
                    records.extend(encode_all(make_events(run.run_id, per_run + 1)[1:]))
                first, second = ("runlog", "raw") if r % 2 == 0 else ("raw", "runlog")
                for which in (first, second):
                    if which == "runlog":
                        rl.append(events_total / _runlog(deps, runs, per_run, batch))
                    else:
                        raw.append(events_total / _raw(settings, records))
            finally:
                for run in runs:
                    run.close()
        out["by_runs"][str(count)] = {
            "runs": count,
            "events": events_total,
            "runlog_events_per_s": summary(rl),
            "raw_kafka_events_per_s": summary(raw),
            "ratio_runlog_over_raw": summary(ratios(rl, raw)),
        }
    out["open_run_new_s"] = {
        "p50": percentile(open_times, 50),
        "p99": percentile(open_times, 99),
        "samples": len(open_times),
    }
    return out
