"""Drain rate of the projection runner against run length.

Writes ``runs`` synthetic runs of ``events_per_run`` events each (``consumers.loadgen``)
to a fresh topic, then times one ``ProjectionRunner.catch_up`` of the given projections
over all of it: the rate a runner drains a backlog at, which is what decides whether it
ever catches up after a burst. Same total per point, so only the run length varies.
"""

from __future__ import annotations

import time
import uuid

from runlog.consumers.loadgen import LoadGenerator
from runlog.consumers.runner import ProjectionRunner
from runlog.log.clients import redis_client
from runlog.settings import Settings
from runlog.topics import ensure_topics


def fresh_settings(base: Settings) -> Settings:
    """The same stack under a topic and key prefix nobody else uses."""
    tag = f"bench{uuid.uuid4().hex[:8]}"
    return base.model_copy(update={"topic_prefix": tag, "redis_key_prefix": tag})


def drain_rate(
    base: Settings, runs: int, events_per_run: int, projections: tuple[str, ...]
) -> float:
    """Events/s of one catch-up over ``runs`` x ``events_per_run`` events."""
    settings = fresh_settings(base)
    ensure_topics(settings)
    gen = LoadGenerator(settings)
    gen.generate(runs, events_per_run)
    total = gen.sent
    client = redis_client(settings)
    runner = ProjectionRunner(settings, client, list(projections))
    started = time.perf_counter()
    runner.catch_up()
    took = time.perf_counter() - started
    return total / took
