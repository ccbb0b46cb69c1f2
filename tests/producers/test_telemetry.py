"""Telemetry in the formats operators collect: a worker's lease, append and barrier counters
served by prometheus_client, read back by Prometheus' own parser."""

from __future__ import annotations

import socket
import urllib.request

from projections_support import prometheus_sample
from workers.common import services_for

import runlog
from runlog._settings import Settings


def test_worker_exports_lease_and_append_metrics(test_settings: Settings) -> None:
    start = runlog.append_metrics()
    before = start["acknowledged"]
    before_barriers = start["barriers_served"] + start["barriers_followed"]
    leases = runlog.lease_metrics().get("acquired", 0)
    with services_for(test_settings), runlog.open_run(tenant="acme", settings=test_settings) as run:
        run.append("user_message", content="hello")
        run.finish("succeeded")
    after = runlog.append_metrics()
    assert after["acknowledged"] >= before + 3  # started, message, finished
    assert after["ack_seconds"] > 0
    barriers = after["barriers_served"] + after["barriers_followed"]
    assert barriers >= before_barriers + 3  # the claim, the message, the finish
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
    for how in ("served", "followed"):
        exported = prometheus_sample(text, "runlog_writer_barriers_total", how=how)
        assert exported == after[f"barriers_{how}"]
    assert prometheus_sample(text, "process_resident_memory_bytes") is not None


def test_spans_for_open_decide_tool_calls_and_reconciliation(test_settings: Settings) -> None:
    """With a tracer provider configured, a run's work shows up as spans with its ids."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)  # once per process: nothing else in the suite sets one

    attempts: list[str] = []

    def pay_fn(args: dict[str, object], *, idempotency_key: str) -> str:
        attempts.append(idempotency_key)
        if len(attempts) == 1:
            raise TimeoutError("gateway timed out after sending")
        return "paid"

    pay = runlog.tool(
        "pay",
        risk="irreversible",
        reconcile=lambda a, **k: runlog.Absent("none"),
        receiver="dedupes_by_key",
    )(pay_fn)
    with services_for(test_settings):
        with runlog.open_run(tenant="acme", tools=[pay], settings=test_settings) as run:
            assert run.call_tool("pay", {"eur": 5}) == "paid"
            approval = run.request_approval("close the books")
            rid, epoch = run.run_id, run.epoch
        runlog.decide(
            rid, approval, approved=True, decided_by="ann", tenant="acme", settings=test_settings
        )
    spans = {s.name: s for s in exporter.get_finished_spans()}
    opened = spans["runlog.open_run"].attributes or {}
    assert opened["runlog.run_id"] == rid and opened["runlog.tenant"] == "acme"
    assert opened["runlog.epoch"] == epoch and opened["runlog.seq"] == 1
    calls = [s for s in exporter.get_finished_spans() if s.name == "runlog.tool_call"]
    assert [dict(s.attributes or {})["runlog.attempt"] for s in calls] == [1, 2]
    first = dict(calls[0].attributes or {})
    assert first["runlog.idempotency_key"] == attempts[0] == attempts[1]
    assert first["runlog.run_id"] == rid and first["runlog.epoch"] == epoch
    assert first["runlog.seq"] >= 2 and first["runlog.tool"] == "pay"
    assert calls[0].status.status_code.name == "ERROR"  # the timeout is on the span
    looked = dict(spans["runlog.reconcile"].attributes or {})
    assert looked["runlog.evidence"] == "Absent" and looked["runlog.idempotency_key"] == attempts[0]
    decided = dict(spans["runlog.decide"].attributes or {})
    assert decided["runlog.approval_id"] == approval and decided["runlog.outcome"] == "recorded"
