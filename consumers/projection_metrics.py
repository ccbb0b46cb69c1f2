"""Projection metrics: lag per partition, applied and quarantined records, the uncertain queue.

Durable numbers come from Redis (positions and counters written in the same transaction
as the effects) and Kafka (high watermarks), so any process can report them: ``runlog
metrics --json`` and the Prometheus text endpoint of ``runlog project --metrics-port``
use the same ``collect``. Standard library only (``http.server``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import redis
from confluent_kafka import Consumer

from runlog.consumers import queries
from runlog.log.kafka import high_watermark, reader_config
from runlog.settings import Settings

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


def _esc(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def to_prometheus(snapshot: dict[str, Any], runner: dict[str, Any] | None = None) -> str:
    """Prometheus text exposition (version 0.0.4) of ``collect``'s snapshot."""
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[dict[str, str], Any]]) -> None:
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            lbl = ",".join(f'{k}="{_esc(v)}"' for k, v in labels.items())
            lines.append(f"{name}{{{lbl}}} {value}" if lbl else f"{name} {value}")

    lag, applied, quarantined, position = [], [], [], []
    for proj, body in snapshot["projections"].items():
        for part, row in body["partitions"].items():
            labels = {"projection": proj, "partition": part}
            lag.append((labels, row["lag"]))
            applied.append((labels, row["applied"]))
            quarantined.append((labels, row["quarantined"]))
            position.append((labels, -1 if row["position"] is None else row["position"]))
    metric("runlog_projection_lag_records", "gauge", "High watermark minus next offset.", lag)
    metric("runlog_projection_position", "gauge", "Last applied offset (-1: none).", position)
    metric("runlog_projection_applied_total", "counter", "Records folded.", applied)
    metric("runlog_projection_quarantined_total", "counter", "Records quarantined.", quarantined)
    unc = snapshot.get("uncertain")
    if unc is not None:
        metric(
            "runlog_uncertain_calls_open",
            "gauge",
            "Open uncertain calls by risk class.",
            [({"risk": r}, n) for r, n in sorted(unc["open_by_risk"].items())],
        )
        metric(
            "runlog_uncertain_oldest_age_seconds",
            "gauge",
            "Age of the oldest open uncertain call by risk class.",
            [({"risk": r}, a) for r, a in sorted(unc["oldest_age_s"].items())],
        )
        metric(
            "runlog_uncertain_calls_overdue",
            "gauge",
            "Open uncertain calls past their risk class's deadline.",
            [({}, unc["overdue"])],
        )
        metric(
            "runlog_uncertain_calls_total",
            "counter",
            "Uncertain calls by what happened to them.",
            [({"event": k}, v) for k, v in sorted(unc["counters"].items())],
        )
    if runner is not None:
        metric(
            "runlog_runner_applied_total",
            "counter",
            "Records folded by this process.",
            [({"projection": k}, v) for k, v in sorted(runner["applied"].items())],
        )
        metric(
            "runlog_runner_consumer_lag_records",
            "gauge",
            "Consumer lag of this process's assigned partitions.",
            [({"partition": str(k)}, v) for k, v in sorted(runner["lag"].items())],
        )
    return "\n".join(lines) + "\n"


def serve(port: int, render: Callable[[], str], host: str = "127.0.0.1") -> ThreadingHTTPServer:
    """Serve ``render()`` at ``/metrics`` from a daemon thread; returns the server."""

    class _Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?")[0] not in ("/metrics", "/"):
                self.send_error(404)
                return
            try:
                body = render().encode()
            except Exception as exc:  # noqa: BLE001 - report a scrape failure, keep serving
                self.send_error(503, f"{type(exc).__name__}: {exc}")
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug(format, *args)

    server = ThreadingHTTPServer((host, port), _Handler)
    threading.Thread(target=server.serve_forever, name="runlog-metrics", daemon=True).start()
    return server
