"""Broker faults: kill -9 a partition leader, and restart brokers, while workers append."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

from faultkit import (
    EffectLedger,
    FaultReport,
    Journal,
    finish_and_check,
    partition_leaders,
    supervise,
    wait_full_isr,
)

from runlog import stack
from runlog.schemas.keys import new_run_id, partition_for
from runlog.settings import Settings

RUNS = 4
TARGET = 40


def test_kill_9_partition_leader_while_workers_append(
    healthy: Settings, cluster: stack.StackConfig, report: FaultReport, tmp_path: Path
) -> None:
    t0 = time.monotonic()
    settings = healthy
    run_ids = [new_run_id() for _ in range(RUNS)]
    journal = Journal()
    ledger = EffectLedger(tmp_path / "effects.log")
    killed: list[int] = []

    def inject() -> None:
        # Once every run is under way, kill -9 the leader of the busiest partition.
        if killed or len(journal.acks) < RUNS * 5:
            return
        parts = [partition_for(r, settings.partitions) for r in run_ids]
        busiest = max(set(parts), key=parts.count)
        leader = partition_leaders(settings)[busiest][0]
        if stack.kill_node(cluster, leader, sig=signal.SIGKILL) is not None:
            killed.append(leader)
            report.faults["kill -9 partition leader"] += 1

    finished = supervise(
        settings, run_ids, journal, ledger, target=TARGET, deadline_s=150, on_progress=inject
    )
    assert killed, "the fault was never injected"
    restart = time.monotonic()
    stack.start_node(cluster, killed[0])
    report.faults["restart killed broker"] += 1
    caught_up = wait_full_isr(settings)
    report.notes.append(
        f"kill -9 leader: node {killed[0]} back in every ISR {time.monotonic() - restart:.1f}s "
        f"after restart (ISR wait {caught_up:.1f}s)"
    )
    finish_and_check("kill-leader", settings, run_ids, journal, ledger, report, finished)
    report.durations["kill_9_leader"] = time.monotonic() - t0


def test_restart_brokers_one_at_a_time_while_workers_append(
    healthy: Settings, cluster: stack.StackConfig, report: FaultReport, tmp_path: Path
) -> None:
    """A rolling restart: SIGTERM each node in turn, start it again, wait for its ISR."""
    t0 = time.monotonic()
    settings = healthy
    run_ids = [new_run_id() for _ in range(RUNS)]
    journal = Journal()
    ledger = EffectLedger(tmp_path / "effects.log")
    stop = threading.Event()
    done_nodes: list[int] = []

    def roll() -> None:
        try:
            while len(journal.acks) < RUNS * 3:
                time.sleep(0.1)
            for node in cluster.nodes():
                restart(node.node_id)
        finally:
            stop.set()  # the workload runs for as long as the restarts do

    def restart(node_id: int) -> None:
        stack.stop_node(cluster, node_id)
        report.faults["broker stop (SIGTERM) + restart"] += 1
        time.sleep(1.0)
        stack.start_node(cluster, node_id)
        wait_full_isr(settings)
        done_nodes.append(node_id)

    roller = threading.Thread(target=roll, daemon=True)
    roller.start()
    finished = supervise(
        settings, run_ids, journal, ledger, target=10_000, deadline_s=170, pace_s=0.02, stop=stop
    )
    roller.join(timeout=120)
    assert done_nodes == [n.node_id for n in cluster.nodes()], done_nodes
    report.notes.append(f"rolling restart: nodes {done_nodes} restarted while runs appended")
    finish_and_check("rolling-restart", settings, run_ids, journal, ledger, report, finished)
    report.durations["rolling_restart"] = time.monotonic() - t0
