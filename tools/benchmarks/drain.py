"""Drain rate of the projection runner against run length.

Writes ``runs`` synthetic runs of ``events_per_run`` events each (``tools.loadgen``)
to a fresh topic, then times one ``ProjectionRunner.catch_up`` of the given projections
over all of it: the rate a runner drains a backlog at, which is what decides whether it
ever catches up after a burst. Same total per point, so only the run length varies.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid

from runlog._settings import Settings
from runlog._topics import ensure_topics
from runlog.consumers.runner import ProjectionRunner
from runlog.log._clients import redis_client
from tools.loadgen import LoadGenerator


def fresh_settings(base: Settings) -> Settings:
    """The same stack under a topic and key prefix nobody else uses."""
    tag = f"bench{uuid.uuid4().hex[:8]}"
    return base.model_copy(update={"topic_prefix": tag, "redis_key_prefix": tag})


def drain_rate(
    base: Settings, runs: int, events_per_run: int, projections: tuple[str, ...]
) -> float:
    """Events/s of one catch-up over ``runs`` x ``events_per_run`` events."""
    return drain(base, runs, events_per_run, projections)[0]


def drain(
    base: Settings,
    runs: int,
    events_per_run: int,
    projections: tuple[str, ...],
    *,
    batch: int | None = None,
) -> tuple[float, float]:
    """(events per wall second, events per CPU second of this process) of one catch-up.

    CPU time (``time.process_time``: this process, librdkafka's threads included, not
    Redis's) is what to compare on a shared machine, where wall time mostly measures the
    load. ``batch`` limits each catch-up batch, as live batches are under a steady load.
    """
    settings = fresh_settings(base)
    ensure_topics(settings)
    gen = LoadGenerator(settings)
    gen.generate(runs, events_per_run)
    total = gen.sent
    client = redis_client(settings)
    if batch is None:
        runner = ProjectionRunner(settings, client, list(projections))
    else:
        runner = ProjectionRunner(settings, client, list(projections), batch_size=batch)
        runner.catch_up_batch = batch
    started, cpu = time.perf_counter(), time.process_time()
    runner.catch_up()
    took, used = time.perf_counter() - started, time.process_time() - cpu
    return total / took, total / used


def main(argv: list[str] | None = None) -> int:
    """``python -m tools.benchmarks.drain RUNS EVENTS_PER_RUN [--batch N]``."""
    p = argparse.ArgumentParser(prog="python -m tools.benchmarks.drain", description=__doc__)
    p.add_argument("runs", type=int)
    p.add_argument("events_per_run", type=int)
    p.add_argument("--batch", type=int, default=None, help="records per catch-up batch")
    args = p.parse_args(argv)
    from runlog.consumers.stores import PROJECTIONS

    wall, cpu = drain(Settings(), args.runs, args.events_per_run, PROJECTIONS, batch=args.batch)
    print(f"drain {wall:.0f} events/s, {cpu:.0f} events/cpu-s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
