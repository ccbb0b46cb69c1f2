"""Projection metrics: lag per partition, applied and quarantined records, the uncertain queue.

Durable numbers come from Redis (positions and counters written in the same transaction
as the effects) and Kafka (high watermarks), so any process can report them: ``runlog
metrics --json`` and the Prometheus endpoint of ``runlog project --metrics-port`` use the
same ``collect``. The exposition and its HTTP server are prometheus_client's.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar
from wsgiref.simple_server import WSGIServer

import redis
from confluent_kafka import Consumer
from prometheus_client import (
    CollectorRegistry,
    ProcessCollector,
    generate_latest,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from runlog._settings import Settings
from runlog.consumers import _queries as queries
from runlog.log._kafka import high_watermark, reader_config

log = logging.getLogger(__name__)


class Watermarks:
    """High watermarks of the events topic through a consumer that never subscribes."""

    def __init__(self, settings: Settings) -> None:
        conf = reader_config(settings)
        self.topic = settings.events_topic
        self._consumer = Consumer(conf, logger=log)
        self._lock = threading.Lock()

    def high(self, partition: int) -> int:
        with self._lock:
            return high_watermark(self._consumer, self.topic, partition)

    def close(self) -> None:
        with self._lock:
            self._consumer.close()


def collect(
    client: redis.Redis,
    settings: Settings,
    projections: Sequence[str],
    watermarks: Callable[[int], int],
) -> dict[str, Any]:
    """A JSON-ready snapshot of every projection's progress and of the uncertain queue."""
    highs = {p: watermarks(p) for p in range(settings.partitions)}
    out: dict[str, Any] = {"topic": settings.events_topic, "projections": {}}
    broken = set(queries.incomplete(client, settings, projections))
    for name in projections:
        parts = queries.positions(client, settings, name)
        per: dict[str, Any] = {}
        for p, row in parts.items():
            pos = row["position"]
            nxt = 0 if pos is None else pos + 1
            per[str(p)] = {**row, "high_watermark": highs[p], "lag": max(0, highs[p] - nxt)}
        out["projections"][name] = {
            "partitions": per,
            "lag": sum(v["lag"] for v in per.values()),
            "applied": sum(int(v["applied"] or 0) for v in per.values()),
            "quarantined": sum(int(v["quarantined"] or 0) for v in per.values()),
            "sealed_no_key": sum(int(v["sealed_no_key"] or 0) for v in per.values()),
            "sealed_runs": sum(int(v["sealed_runs"] or 0) for v in per.values()),
            "rebuild_incomplete": name in broken,
        }
    if "uncertain" in projections:
        rep = queries.uncertain_report(client, settings)
        open_by_risk: dict[str, int] = {}
        for call in rep.open:
            open_by_risk[call["risk"]] = open_by_risk.get(call["risk"], 0) + 1
        out["uncertain"] = {
            "counters": rep.counters,
            "still_open": len(rep.open),
            "open_by_risk": open_by_risk,
            "by_status": rep.by_status,
            "oldest_age_s": rep.oldest_age_s,
            "overdue": len(rep.overdue),
        }
    return out


Families = list[Metric]
_Family = TypeVar("_Family", GaugeMetricFamily, CounterMetricFamily)


def families(snapshot: dict[str, Any], runner: dict[str, Any] | None = None) -> Families:
    """Prometheus metric families of ``collect``'s snapshot (and a runner's own counters)."""

    def gauge(name: str, help_: str, labels: list[str]) -> GaugeMetricFamily:
        return GaugeMetricFamily(name, help_, labels=labels)

    def counter(name: str, help_: str, labels: list[str]) -> CounterMetricFamily:
        return CounterMetricFamily(name, help_, labels=labels)

    def per_label(family: _Family, values: dict[Any, float]) -> _Family:
        """A sample per key of ``values`` (in key order), labelled with the key."""
        for key, value in sorted(values.items()):
            family.add_metric([str(key)], value)
        return family

    by = ["projection", "partition"]
    lag = gauge("runlog_projection_lag_records", "High watermark minus next offset.", by)
    position = gauge("runlog_projection_position", "Last applied offset (-1: none).", by)
    applied = counter("runlog_projection_applied", "Records folded.", by)
    quarantined = counter("runlog_projection_quarantined", "Records quarantined.", by)
    sealed = counter(
        "runlog_projection_sealed_no_key",
        "Sealed records folded without a key store (their content reads erased).",
        by,
    )
    for proj, body in snapshot["projections"].items():
        for part, row in body["partitions"].items():
            labels = [proj, str(part)]
            lag.add_metric(labels, row["lag"])
            applied.add_metric(labels, row["applied"])
            quarantined.add_metric(labels, row["quarantined"])
            sealed.add_metric(labels, row.get("sealed_no_key", 0))
            position.add_metric(labels, -1 if row["position"] is None else row["position"])
    incomplete = gauge(
        "runlog_projection_rebuild_incomplete",
        "1 while a rebuild that died has left the projection half done (not to be trusted).",
        ["projection"],
    )
    for proj, body in snapshot["projections"].items():
        incomplete.add_metric([proj], 1 if body.get("rebuild_incomplete") else 0)
    out: Families = [lag, position, applied, quarantined, sealed, incomplete]
    unc = snapshot.get("uncertain")
    if unc is not None:
        open_ = gauge(
            "runlog_uncertain_calls_open", "Open uncertain calls by risk class.", ["risk"]
        )
        oldest = gauge(
            "runlog_uncertain_oldest_age_seconds",
            "Age of the oldest open uncertain call by risk class.",
            ["risk"],
        )
        overdue = gauge(
            "runlog_uncertain_calls_overdue", "Open uncertain calls past their deadline.", []
        )
        overdue.add_metric([], unc["overdue"])
        calls = counter(
            "runlog_uncertain_calls", "Uncertain calls by what happened to them.", ["event"]
        )
        out += [
            per_label(open_, unc["open_by_risk"]),
            per_label(oldest, unc["oldest_age_s"]),
            overdue,
            per_label(calls, unc["counters"]),
        ]
    if runner is not None:
        mine = counter("runlog_runner_applied", "Records folded by this process.", ["projection"])
        consumer_lag = gauge(
            "runlog_runner_consumer_lag_records",
            "Consumer lag of this process's assigned partitions.",
            ["partition"],
        )
        out += [per_label(mine, runner["applied"]), per_label(consumer_lag, runner["lag"])]
    return out


class _Families(Collector):
    """Calls ``produce`` at every scrape (a live view), or once (``to_prometheus``)."""

    def __init__(self, produce: Callable[[], Families]) -> None:
        self._produce = produce

    def collect(self) -> Iterable[Metric]:
        return self._produce()


def to_prometheus(snapshot: dict[str, Any], runner: dict[str, Any] | None = None) -> str:
    """Prometheus text exposition of ``collect``'s snapshot (``runlog metrics``)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(lambda: families(snapshot, runner)))
    return generate_latest(registry).decode()


def serve(
    port: int, produce: Callable[[], Families], host: str = "127.0.0.1"
) -> tuple[WSGIServer, threading.Thread]:
    """Serve ``produce()`` (plus this process's CPU and memory) at ``/metrics`` with
    prometheus_client's server, on a daemon thread; ``shutdown()`` the server to stop.

    A failed scrape (Redis or Kafka away) answers 500 and the server keeps serving.
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(produce))
    ProcessCollector(registry=registry)
    return start_http_server(port, addr=host, registry=registry)
