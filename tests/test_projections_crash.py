"""SIGKILL at any moment loses nothing and applies nothing twice; a group shares the work."""

from __future__ import annotations

import random
import signal
import socket
import threading
import time
import urllib.request
from pathlib import Path

import redis
from projections_support import (
    applied_total,
    dump,
    prometheus_sample,
    start_runner,
    stop,
    wait_assigned,
    wait_caught_up,
)

from runlog.consumers.loadgen import LoadGenerator
from runlog.consumers.runner import ProjectionRunner
from runlog.consumers.store import PROJECTIONS
from runlog.settings import Settings


def _reference(settings: Settings, client: redis.Redis) -> dict:
    """The same projections, folded without interruption into another key prefix."""
    ref = settings.model_copy(update={"redis_key_prefix": settings.redis_key_prefix + "-ref"})
    ProjectionRunner(ref, client, PROJECTIONS).catch_up(timeout_s=120)
    return dump(client, ref)


def _every_record_once(client: redis.Redis, settings: Settings, highs: dict[int, int]) -> None:
    total = sum(highs.values())
    for name in PROJECTIONS:
        # applied + quarantined is incremented in the transaction that advances the
        # position: a lost record makes it smaller, a doubled one larger.
        assert applied_total(client, settings, name) == total, name


def test_sigkill_mid_stream_many_times(
    test_settings: Settings, redis_client: redis.Redis, unique_group, tmp_path: Path
) -> None:
    group = unique_group("kill")
    gen = LoadGenerator(test_settings, seed=5)
    writer = threading.Thread(
        target=gen.steady, kwargs={"rate_per_s": 600, "duration_s": 12.0, "runs": 40}
    )
    writer.start()
    rng = random.Random(42)
    kills = 0
    log = str(tmp_path / "runner.log")
    try:
        while kills < 5:
            before = applied_total(redis_client, test_settings, "state")
            proc = start_runner(test_settings, "all", group, log_path=log)
            deadline = time.monotonic() + 30
            while applied_total(redis_client, test_settings, "state") == before:
                assert proc.poll() is None, Path(log).read_text()[-2000:]
                assert time.monotonic() < deadline, "runner applied nothing in 30 s"
                time.sleep(0.05)
            time.sleep(rng.uniform(0.0, 0.4))  # somewhere in the middle of batches
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
            kills += 1
    finally:
        writer.join()
    # Restart once more; it must finish what the killed ones left, and stop on SIGTERM.
    Path(log).write_text("")
    proc = start_runner(test_settings, "all", group, "--metrics-port", "0", log_path=log)
    try:
        # The killed runners may have finished everything already: stop it only once it
        # is really running, or SIGTERM lands before its handler exists (exit -15).
        wait_assigned(proc, log)
        highs = wait_caught_up(redis_client, test_settings, timeout=90)
    finally:
        assert stop(proc) == 0, Path(log).read_text()[-2000:]
    _every_record_once(redis_client, test_settings, highs)
    assert dump(redis_client, test_settings) == _reference(test_settings, redis_client)


def test_two_runners_in_a_group_one_killed(
    test_settings: Settings, redis_client: redis.Redis, unique_group, tmp_path: Path
) -> None:
    group = unique_group("pair")
    gen = LoadGenerator(test_settings, seed=9)
    gen.generate(runs=10, events_per_run=10)
    logs = [str(tmp_path / "a.log"), str(tmp_path / "b.log")]
    a = start_runner(test_settings, "state", group, log_path=logs[0])
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    b = start_runner(test_settings, "state", group, "--metrics-port", str(port), log_path=logs[1])
    try:
        # Both members hold partitions before one dies.
        deadline = time.monotonic() + 60
        while not all("assigned {" in Path(p).read_text() for p in logs):
            assert time.monotonic() < deadline, [Path(p).read_text()[-1000:] for p in logs]
            time.sleep(0.2)
        writer = threading.Thread(
            target=gen.steady, kwargs={"rate_per_s": 500, "duration_s": 6.0, "runs": 30}
        )
        writer.start()
        time.sleep(2.0)
        a.send_signal(signal.SIGKILL)
        a.wait(timeout=10)
        writer.join()
        highs = wait_caught_up(redis_client, test_settings, ("state",), timeout=90)
        # The survivor owns every partition now (eager rebalance: a fresh full assignment).
        assert "assigned {0: " in Path(logs[1]).read_text().split("revoked")[-1]
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
        lag = prometheus_sample(
            body.decode(), "runlog_projection_lag_records", projection="state", partition="0"
        )
        assert lag == 0
    finally:
        stop(a, signal.SIGKILL)
        assert stop(b) == 0, Path(logs[1]).read_text()[-2000:]
    total = sum(highs.values())
    assert applied_total(redis_client, test_settings, "state") == total
    ref = test_settings.model_copy(
        update={"redis_key_prefix": test_settings.redis_key_prefix + "-ref"}
    )
    ProjectionRunner(ref, redis_client, ("state",)).catch_up(timeout_s=120)
    assert dump(redis_client, test_settings, ("state",)) == dump(redis_client, ref, ("state",))
