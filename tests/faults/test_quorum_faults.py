"""A broker cut from the KRaft controller quorum while workers append with ``acks=all``.

The node leading the busiest partition is cut from the quorum (tests/faults/netns.py,
``QuorumCut``: its sends to the other controllers and everything to its own controller
port dropped on loopback) while its broker port stays reachable: it cannot heartbeat
(fenced after ``broker.session.timeout.ms``, 6 s here), cannot vote and cannot learn the
new leaders, yet clients and followers still reach it. After ``CUT_S`` it is healed and
must rejoin every ISR. Every append a writer was told is durable must be valid in the
log, no event twice, no two owners, each effect once.

Reproduce: ``.venv/bin/python -m pytest tests/faults -k partition_broker`` (seed ``SEED``).
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from pathlib import Path

from faultkit import FaultReport, Workload, partition_leaders, wait_full_isr
from netns import QuorumCut, check_available

from runlog import stack
from runlog._settings import Settings
from runlog.schemas._keys import partition_for

SEED = 4209
RUNS = 4


def test_partition_broker_cut_from_quorum_loses_no_acknowledged_event(
    healthy: Settings, cluster: stack.StackConfig, report: FaultReport, tmp_path: Path
) -> None:
    check_available()
    rng = random.Random(SEED)
    cut_s = rng.choice([12.0, 14.0])
    work = Workload.start(healthy, RUNS, tmp_path / "effects.log")
    settings, run_ids, journal = work.settings, work.run_ids, work.journal
    cuts: list[QuorumCut] = []
    cut_at: list[float] = []
    acked_before: list[int] = []
    healed_at: list[float] = []
    during: list[dict[int, tuple[int, list[int]]]] = []
    """Leaders and ISRs as a node still in the quorum reports them, from 6 s into the cut."""
    sampled: list[float] = []
    stop = threading.Event()

    def inject() -> None:
        if not cuts and len(journal.acks) >= RUNS * 3:
            parts = [partition_for(r, settings.partitions) for r in run_ids]
            busiest = max(set(parts), key=parts.count)
            leader = partition_leaders(settings)[busiest][0]
            pid = stack.node_pid(cluster, leader)
            assert pid is not None, f"node {leader} is not running"
            node = cluster.node(leader)
            others = [n.controller_port for n in cluster.nodes() if n.node_id != leader]
            cut = QuorumCut(pid, node.controller_port, others)
            cut.cut()
            cuts.append(cut)
            cut_at.append(time.monotonic())
            acked_before.append(len(journal.acks))
            report.faults[f"partition: broker {leader} cut from the controller quorum"] += 1
        elif cuts and cut_at and time.monotonic() - max([cut_at[0] + 5, *sampled]) > 1:
            # Fenced after its session timeout (6 s; counted from a new controller's
            # election when the node was the active one): asked of a node in the quorum.
            sampled.append(time.monotonic())
            inside = next(n for n in cluster.nodes() if n.controller_port != cuts[0].own_port)
            there = settings.model_copy(
                update={"bootstrap_servers": f"127.0.0.1:{inside.kafka_port}"}
            )
            with contextlib.suppress(Exception):  # a metadata request may time out here
                during.append(partition_leaders(there))
        elif cuts and cut_at and time.monotonic() - cut_at[0] > cut_s:
            cuts[0].heal()
            cut_at.clear()
            healed_at.append(time.monotonic())
        elif healed_at and time.monotonic() - healed_at[0] > 3:
            stop.set()  # the runs finish once they appended across the heal too

    try:
        finished = work.supervise(
            target=10_000, deadline_s=cut_s + 40, pace_s=0.02, on_progress=inject, stop=stop
        )
    finally:
        for cut in cuts:
            cut.heal()
    assert cuts, "the fault was never injected"
    dropped = cuts[0].dropped
    assert dropped > 0, "the quorum cut dropped nothing"
    # Fenced after its session timeout: it leads no partition and is in no ISR any more.
    isolated = next(n.node_id for n in cluster.nodes() if n.controller_port == cuts[0].own_port)
    fenced = [
        view
        for view in during
        if all(ldr != isolated and isolated not in isr for ldr, isr in view.values())
    ]
    assert fenced, f"node {isolated} was never fenced while cut off: {during[-1:]}"
    caught_up = wait_full_isr(settings)
    report.notes.append(
        f"quorum cut seed {SEED}: node {isolated} for {cut_s:.0f}s, fenced in "
        f"{len(fenced)}/{len(during)} samples, {dropped} controller packets dropped, "
        f"{len(journal.acks) - acked_before[0]} appends acknowledged after the cut, "
        f"full ISR {caught_up:.1f}s after"
    )
    work.check("quorum-cut", report, finished, timed_as="partition_broker_quorum")
