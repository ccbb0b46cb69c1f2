"""Broker faults: kill -9 a partition leader, and restart brokers, while workers append."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

from faultkit import (
    FaultReport,
    Workload,
    partition_leaders,
    wait_full_isr,
)

from runlog import stack
from runlog._settings import Settings
from runlog.schemas._keys import partition_for

RUNS = 4
TARGET = 40


def test_kill_9_partition_leader_while_workers_append(
    healthy: Settings, cluster: stack.StackConfig, report: FaultReport, tmp_path: Path
) -> None:
    work = Workload.start(healthy, RUNS, tmp_path / "effects.log")
    settings, run_ids, journal = work.settings, work.run_ids, work.journal
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

    finished = work.supervise(target=TARGET, deadline_s=150, on_progress=inject)
    assert killed, "the fault was never injected"
    restart = time.monotonic()
    stack.start_node(cluster, killed[0])
    report.faults["restart killed broker"] += 1
    caught_up = wait_full_isr(settings)
    report.notes.append(
        f"kill -9 leader: node {killed[0]} back in every ISR {time.monotonic() - restart:.1f}s "
        f"after restart (ISR wait {caught_up:.1f}s)"
    )
    work.check("kill-leader", report, finished, timed_as="kill_9_leader")


def test_restart_brokers_one_at_a_time_while_workers_append(
    healthy: Settings, cluster: stack.StackConfig, report: FaultReport, tmp_path: Path
) -> None:
    """A rolling restart: SIGTERM each node in turn, start it again, wait for its ISR."""
    work = Workload.start(healthy, RUNS, tmp_path / "effects.log")
    settings, journal = work.settings, work.journal
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
    finished = work.supervise(target=10_000, deadline_s=170, pace_s=0.02, stop=stop)
    roller.join(timeout=120)
    assert done_nodes == [n.node_id for n in cluster.nodes()], done_nodes
    report.notes.append(f"rolling restart: nodes {done_nodes} restarted while runs appended")
    work.check("rolling-restart", report, finished, timed_as="rolling_restart")
