"""Redis faults on the cluster's private Redis (AOF, everysec): restarts and an outage.

The shared single-node stack's Redis is never touched: the cluster has its own
(``runlog stack up --nodes 3`` starts it on 26379) and these tests restart that one.
"""

from __future__ import annotations

import signal
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

from faultkit import (
    FaultReport,
    Workload,
    read_log,
)

from runlog import stack
from runlog._settings import Settings

RUNS = 3


def test_redis_restarts_during_runs_keep_one_owner_and_epochs_rising(
    healthy: Settings, cluster: stack.StackConfig, report: FaultReport, tmp_path: Path
) -> None:
    """kill -9 Redis and restart it from its AOF, then again with its data lost.

    Two contenders per run keep trying to own it, so a Redis that forgot a lease or an
    epoch would show as two owners or a reused epoch.
    """
    work = Workload.start(healthy, RUNS, tmp_path / "effects.log")
    journal = work.journal
    stop = threading.Event()

    def faults() -> None:
        for empty, label in ((False, "AOF kept"), (True, "data lost")):
            start = len(journal.acks)
            while len(journal.acks) < start + RUNS * 4 and not stop.is_set():
                time.sleep(0.1)
            if stop.is_set():
                return
            stack.kill_redis(cluster, sig=signal.SIGKILL)
            time.sleep(0.5)
            stack.start_redis(cluster, empty=empty)
            report.faults[f"redis kill -9 + restart ({label})"] += 1

    injector = threading.Thread(target=faults, daemon=True)
    injector.start()
    finished = work.supervise(target=30, deadline_s=170, pace_s=0.05, contenders=2)
    stop.set()
    injector.join(timeout=30)
    assert report.faults["redis kill -9 + restart (data lost)"] >= 1, "faults not injected"
    work.check("redis-restart", report, finished, timed_as="redis_restarts")


def test_redis_down_appends_fail_safe_and_resume_after(
    healthy: Settings, cluster: stack.StackConfig, report: FaultReport, tmp_path: Path
) -> None:
    """Redis is gone for 2.5 lease TTLs while runs append.

    No append may be acknowledged to a writer while Redis is down (the post-ack ownership
    check cannot succeed), and no event may reach Kafka after the writer's lease could
    have expired: a write is produced only within the lease's local validity (0.8 TTL
    after its last renewal, which happened before Redis went down).
    """
    work = Workload.start(healthy, RUNS, tmp_path / "effects.log")
    settings, run_ids, journal = work.settings, work.run_ids, work.journal
    ttl = settings.lease_ttl_ms / 1000
    window: dict[str, float] = {}

    def outage() -> None:
        while len(journal.acks) < RUNS * 6:
            time.sleep(0.05)
        stack.kill_redis(cluster, sig=signal.SIGKILL)
        window["down_wall"], window["down_mono"] = time.time(), time.monotonic()
        time.sleep(2.5 * ttl)
        window["up_wall"], window["up_mono"] = time.time(), time.monotonic()
        stack.start_redis(cluster)
        report.faults["redis down for 2.5 lease TTLs"] += 1

    injector = threading.Thread(target=outage, daemon=True)
    injector.start()
    finished = work.supervise(target=40, deadline_s=170, pace_s=0.05)
    injector.join(timeout=30)
    assert "up_mono" in window, "the outage was never injected"

    slack = 0.3
    acked_while_down = [
        a for a in journal.acks if window["down_mono"] + slack < a.mono < window["up_mono"]
    ]
    expired_from = datetime.fromtimestamp(window["down_wall"] + 0.8 * ttl + slack, UTC)
    down_from = datetime.fromtimestamp(window["down_wall"], UTC)
    up_at = datetime.fromtimestamp(window["up_wall"], UTC)
    written_unleased = []
    written_in_validity = 0
    for r in run_ids:
        for rec in read_log(settings, r):
            at = rec.event.occurred_at
            if expired_from < at < up_at:
                written_unleased.append(f"{r} seq {rec.event.seq} at {at.isoformat()}")
            elif down_from <= at <= expired_from:
                written_in_validity += 1
    report.notes.append(
        f"redis down {window['up_mono'] - window['down_mono']:.1f}s: "
        f"{len(acked_while_down)} appends acknowledged meanwhile, {written_in_validity} "
        "events produced within the lease's local validity (none acknowledged), "
        f"{len(written_unleased)} after it"
    )
    report.violations.extend(f"acked while Redis down: {a}" for a in acked_while_down)
    report.violations.extend(f"written without a lease: {w}" for w in written_unleased)
    assert not acked_while_down
    assert not written_unleased
    assert journal.stops, "no writer noticed that Redis was gone"
    work.check("redis-down", report, finished, timed_as="redis_down")
