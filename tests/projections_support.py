"""Helpers for the tests that run projection services (tests/consumers/, and the tests
elsewhere that run a runner beside their own subject): real Kafka, Redis and processes."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import redis
from workers.common import FAST_TAKEOVER, worker_env

from runlog._settings import Settings
from runlog.consumers import _queries as queries
from runlog.consumers._projection_metrics import Watermarks
from runlog.consumers.stores import PROJECTIONS
from runlog.log._reader import LogReader
from runlog.projections._run_state import fold


def env_for(settings: Settings, **extra: str) -> dict[str, str]:
    """A runner process's environment: the test's settings, quick to take over after a kill."""
    return worker_env(settings, RUNLOG_KAFKA_EXTRA=FAST_TAKEOVER, **extra)


def start_runner(
    settings: Settings, projection: str, group: str, *args: str, log_path: str | None = None
) -> subprocess.Popen[bytes]:
    out: Any = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115
    return subprocess.Popen(
        [sys.executable, "-m", "runlog.cli", "project", projection, "--group", group, *args],
        env=env_for(settings),
        stdout=out,
        stderr=out,
    )


def wait_assigned(proc: subprocess.Popen[bytes], log_path: str, timeout: float = 30) -> None:
    """Until the runner logged a partition assignment (its signal handlers are in place)."""
    deadline = time.monotonic() + timeout
    while "assigned" not in Path(log_path).read_text(errors="replace"):
        assert proc.poll() is None, Path(log_path).read_text()[-2000:]
        assert time.monotonic() < deadline, "runner was not assigned partitions"
        time.sleep(0.05)


def wait_all_assigned(logs: list[str], timeout: float = 60) -> None:
    """Until every runner whose log is in ``logs`` holds partitions (logged "assigned {")."""
    deadline = time.monotonic() + timeout
    while not all("assigned {" in Path(p).read_text() for p in logs):
        assert time.monotonic() < deadline, [Path(p).read_text()[-1000:] for p in logs]
        time.sleep(0.2)


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 20) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
    return proc.wait(timeout=timeout)


def applied_total(client: redis.Redis, settings: Settings, name: str) -> int:
    rows = queries.positions(client, settings, name)
    return sum(int(r["applied"] or 0) + int(r["quarantined"] or 0) for r in rows.values())


def wait_caught_up(
    client: redis.Redis,
    settings: Settings,
    names: tuple[str, ...] = PROJECTIONS,
    timeout: float = 60,
) -> dict[int, int]:
    """Until every projection's position is just below each partition's high watermark.

    ``timeout`` bounds a wait without progress: a backlog of a million records drains for
    as long as it keeps draining, a stuck runner fails after ``timeout`` seconds.
    """
    marks = Watermarks(settings)
    try:
        highs = {p: marks.high(p) for p in range(settings.partitions)}
        deadline = time.monotonic() + timeout
        least = None
        while True:
            behind = []
            for name in names:
                for p, row in queries.positions(client, settings, name).items():
                    nxt = 0 if row["position"] is None else int(row["position"]) + 1
                    if nxt < highs[p]:
                        behind.append((name, p, highs[p] - nxt))
            if not behind:
                return highs
            left = sum(n for _, _, n in behind)
            if least is None or left < least:
                least, deadline = left, time.monotonic() + timeout
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"projections still behind, no progress for {timeout}s: {behind}"
                )
            time.sleep(0.2)
    finally:
        marks.close()


def dump(client: redis.Redis, settings: Settings, names: tuple[str, ...] = PROJECTIONS) -> dict:
    """Every stored key and exact value of ``names``, with this settings' prefix removed."""
    out: dict[str, Any] = {}
    prefix = settings.redis_key_prefix
    for name in names:
        for key, value in queries.dump_projection(client, settings, name).items():
            assert key.startswith(prefix + ":")
            out[key[len(prefix) :]] = value
    return out


def replayed_states(settings: Settings, run_ids: list[str]) -> dict[str, dict[str, Any]]:
    """The writers' fold of each run, by an independent full read of the log."""
    out = {}
    with LogReader(settings) as reader:
        for rid in run_ids:
            part = reader.partition_of(rid)
            out[rid] = fold(r.event for r in reader.read(rid, partition=part, start=0)).to_dict()
    return out


def prometheus_sample(text: str, name: str, **labels: str) -> float | None:
    """The value of sample ``name`` with ``labels`` in a Prometheus exposition, or None."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return None
