"""The writer's telemetry in Prometheus' terms: lease and append counters of this process.

Operational numbers only, never written to the log: a worker exports them with
``runlog.serve_metrics(port)``; ``runlog.lease_metrics()`` and ``runlog.append_metrics()``
return the same counters as dicts.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, Metric, SummaryMetricFamily

from runlog.producers._lease import METRICS
from runlog.producers._writer import APPENDS, BARRIERS

LEASE_EVENTS = (
    "acquired",
    "takeovers",
    "forced_takeovers",
    "claims_lost",
    "renewed",
    "renew_lost",
    "released",
    "fenced",
)
APPEND_RESULTS = ("acknowledged", "failed", "unknown")


def families() -> list[Metric]:
    lease = CounterMetricFamily(
        "runlog_writer_lease_events",
        "Ownership events of this process: leases acquired, taken over, renewed, lost, "
        "released, and appends stopped by fencing.",
        labels=["event"],
    )
    for event in sorted({*LEASE_EVENTS, *METRICS}):
        lease.add_metric([event], METRICS.get(event, 0))
    appends = CounterMetricFamily(
        "runlog_writer_appends",
        "Appends by what the broker said: acknowledged, failed (refused), unknown (may "
        "still be written: the run stops and the next owner reads the truth from the log).",
        labels=["result"],
    )
    for result in APPEND_RESULTS:
        appends.add_metric([result], APPENDS.get(result, 0))
    ack = SummaryMetricFamily(
        "runlog_writer_append_ack_seconds",
        "Time from produce to the broker's acknowledgement of an append.",
        count_value=int(APPENDS.get("acknowledged", 0)),
        sum_value=APPENDS.get("ack_seconds", 0.0),
    )
    barriers = CounterMetricFamily(
        "runlog_writer_barriers",
        "Barriers by how their acknowledgements came: served (the waiting thread served "
        "its own delivery reports) or followed (woken by the thread serving them).",
        labels=["how"],
    )
    for how in ("served", "followed"):
        barriers.add_metric([how], BARRIERS[how])
    return [lease, appends, ack, barriers]
