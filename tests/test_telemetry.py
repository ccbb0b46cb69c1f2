"""Telemetry in the formats operators collect: a worker's lease and append counters served
by prometheus_client, read back by Prometheus' own parser."""

from __future__ import annotations

import socket
import urllib.request

from projections_support import prometheus_sample
from workers.common import services_for

import runlog
from runlog.settings import Settings


def test_worker_exports_lease_and_append_metrics(test_settings: Settings) -> None:
    before = runlog.append_metrics()["acknowledged"]
    leases = runlog.lease_metrics().get("acquired", 0)
    with services_for(test_settings):
        with runlog.open_run(tenant="acme", settings=test_settings) as run:
            run.append("user_message", content="hello")
            run.finish("succeeded")
    after = runlog.append_metrics()
    assert after["acknowledged"] >= before + 3  # started, message, finished
    assert after["ack_seconds"] > 0
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    stop = runlog.serve_metrics(port)
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    finally:
        stop()
    text = body.decode()
    acked = prometheus_sample(text, "runlog_writer_appends_total", result="acknowledged")
    assert acked == after["acknowledged"]
    acquired = prometheus_sample(text, "runlog_writer_lease_events_total", event="acquired")
    assert acquired is not None and acquired >= leases + 1
    assert prometheus_sample(text, "runlog_writer_append_ack_seconds_count") == acked
    assert prometheus_sample(text, "process_resident_memory_bytes") is not None
