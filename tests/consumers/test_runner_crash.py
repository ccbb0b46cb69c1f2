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
    wait_all_assigned,
    wait_assigned,
    wait_caught_up,
)

from runlog._settings import Settings
from runlog.consumers import _queries as queries
from runlog.consumers._projection_metrics import Watermarks
from runlog.consumers.runner import ProjectionRunner
from runlog.consumers.stores import PROJECTIONS
from tools.loadgen import LoadGenerator


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
    # The writer runs until the last kill: each new runner waits out the killed member's
    # session before it gets partitions, and it must find records to apply when it does.
    done = threading.Event()
    writer = threading.Thread(
        target=gen.steady,
        kwargs={"rate_per_s": 600, "duration_s": 300.0, "runs": 40, "stop": done},
    )
    writer.start()
    rng = random.Random(42)
    kills = 0
    log = str(tmp_path / "runner.log")
    try:
        while kills < 5:
            before = applied_total(redis_client, test_settings, "state")
            proc = start_runner(test_settings, "all", group, log_path=log)
            deadline = time.monotonic() + 60
            while applied_total(redis_client, test_settings, "state") == before:
                assert proc.poll() is None, Path(log).read_text()[-2000:]
                assert time.monotonic() < deadline, "runner applied nothing in 60 s"
                time.sleep(0.05)
            time.sleep(rng.uniform(0.0, 0.4))  # somewhere in the middle of batches
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
            kills += 1
    finally:
        done.set()
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
        wait_all_assigned(logs)  # both members hold partitions before one dies
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


def _records_behind(client: redis.Redis, settings: Settings, marks: Watermarks) -> int:
    """Records in the topic that some projection has not applied yet."""
    behind = 0
    for p in range(settings.partitions):
        high = marks.high(p)
        low = high
        for name in PROJECTIONS:
            row = queries.positions(client, settings, name)[p]
            low = min(low, 0 if row["position"] is None else int(row["position"]) + 1)
        behind += high - low
    return behind


def test_three_runners_one_killed_under_load_equal_a_rebuild(
    test_settings: Settings, redis_client: redis.Redis, unique_group, tmp_path: Path
) -> None:
    """Kafka's group protocol moves a SIGKILLed member's partitions to the others; the
    positions in Redis make their effects exactly-once, so the result is a rebuild's."""
    group = unique_group("three")
    gen = LoadGenerator(test_settings, seed=13)
    gen.generate(runs=12, events_per_run=20)
    logs = [str(tmp_path / f"r{i}.log") for i in range(3)]
    procs = [start_runner(test_settings, "all", group, log_path=log) for log in logs]
    marks = Watermarks(test_settings)
    try:
        wait_all_assigned(logs)
        writer = threading.Thread(
            target=gen.steady, kwargs={"rate_per_s": 800, "duration_s": 14.0, "runs": 40}
        )
        writer.start()
        time.sleep(3.0)
        # The member that holds partitions right now, mid-batch.
        texts = [Path(p).read_text() for p in logs]
        victim = next(
            i for i, t in enumerate(texts) if t[t.rfind("assigned") :].startswith("assigned {0")
        )
        procs[victim].send_signal(signal.SIGKILL)
        procs[victim].wait(timeout=10)
        killed_at = time.monotonic()
        timeline = []
        while writer.is_alive():
            timeline.append(
                (
                    round(time.monotonic() - killed_at, 1),
                    _records_behind(redis_client, test_settings, marks),
                )
            )
            time.sleep(0.25)
        writer.join()
        highs = wait_caught_up(redis_client, test_settings, timeout=90)
        # Not a time limit (the machine is shared): the numbers, for the record.
        print("records behind after the kill (s, records):", timeline)
        for i, proc in enumerate(procs):
            if i != victim:
                assert proc.poll() is None, Path(logs[i]).read_text()[-2000:]
    finally:
        marks.close()
        for i, proc in enumerate(procs):
            code = stop(proc)
            if proc.returncode != -signal.SIGKILL:
                assert code == 0, Path(logs[i]).read_text()[-2000:]
    _every_record_once(redis_client, test_settings, highs)
    assert dump(redis_client, test_settings) == _reference(test_settings, redis_client)
