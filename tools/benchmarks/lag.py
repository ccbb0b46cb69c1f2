"""5. Projection lag: from an append's acknowledgement to the state projection showing it.

A projection runner (``consumers.runner.ProjectionRunner``, the ``state`` projection, the
code behind ``runlog project state``) runs in a subprocess as a consumer-group member. This
process appends at a steady rate round-robin over a few runs (each ``Run.append``
acknowledged) and a sampler thread reads the runner's stored positions from Redis every
millisecond; an event is visible once its partition's position reaches its offset (the
position is written in the same MULTI as the projection update). The runner subprocess
reports its peak RSS when it stops.
"""

from __future__ import annotations

import bisect
import json
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from runlog._settings import Settings
from runlog.consumers._store import ProjectionKeys
from tools.benchmarks.common import percentile, summary, worker_env, workload_payload
from tools.benchmarks.throughput import open_many

SAMPLE_S = 0.001


def _pos_keys(settings: Settings) -> list[str]:

    keys = ProjectionKeys(settings.redis_key_prefix, "state", settings.events_topic)
    return [keys.pos(p) for p in range(settings.partitions)]


class Sampler(threading.Thread):
    """Records (time, positions) whenever a position moves."""

    def __init__(self, client: Any, keys: list[str], interval_s: float = SAMPLE_S) -> None:
        super().__init__(name="bench-lag-sampler", daemon=True)
        self.client = client
        self.keys = keys
        self.stop = threading.Event()
        self.times: list[list[float]] = [[] for _ in keys]
        self.values: list[list[int]] = [[] for _ in keys]
        self.interval_s = interval_s

    def run(self) -> None:
        last = [-2] * len(self.keys)
        while not self.stop.is_set():
            raws = self.client.mget(self.keys)
            now = time.perf_counter()
            for p, raw in enumerate(raws):
                v = -1 if raw is None else int(raw)
                if v != last[p]:
                    last[p] = v
                    self.times[p].append(now)
                    self.values[p].append(v)
            time.sleep(self.interval_s)

    def visible_at(self, partition: int, offset: int) -> float | None:
        i = bisect.bisect_left(self.values[partition], offset)
        return self.times[partition][i] if i < len(self.values[partition]) else None


def _spawn_runner(settings: Settings) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tools.benchmarks.worker", "project"],
        env=worker_env(settings),
        stdout=subprocess.PIPE,
        text=True,
    )


def _one(
    deps: Any, settings: Settings, *, rate: float, seconds: float, runs: int
) -> dict[str, Any]:

    proc = _spawn_runner(settings)
    sampler = Sampler(deps.redis, _pos_keys(settings))
    sampler.start()
    opened, _ = open_many(deps, runs)
    try:
        # Wait until the runner has joined its group and applied what is already there.
        deadline = time.monotonic() + 60
        while any(sampler.visible_at(r.partition, r.last_offset or 0) is None for r in opened):
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("projection runner did not catch up within 60 s")
            time.sleep(0.05)
        acks: list[tuple[int, int, float]] = []
        period = 1 / rate
        t_next = time.perf_counter()
        end = t_next + seconds
        i = 0
        while t_next < end:
            run = opened[i % len(opened)]
            i += 1
            et, payload = workload_payload(run.state.seq + 1)
            run.append(et, payload)
            acks.append((run.partition, int(run.last_offset), time.perf_counter()))
            t_next += period
            time.sleep(max(0.0, t_next - time.perf_counter()))
        deadline = time.monotonic() + 30
        while any(sampler.visible_at(p, o) is None for p, o, _ in acks):
            if time.monotonic() > deadline:
                raise RuntimeError("projection runner fell behind by more than 30 s")
            time.sleep(0.01)
    finally:
        sampler.stop.set()
        sampler.join(timeout=5)
        for run in opened:
            run.close()
        proc.send_signal(signal.SIGTERM)
        stdout, _ = proc.communicate(timeout=60)
    lags = []
    for p, o, t in acks:
        seen = sampler.visible_at(p, o)
        assert seen is not None
        lags.append(max(0.0, seen - t))
    mem = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    return {
        "events": len(acks),
        "p50_ms": percentile(lags, 50) * 1000,
        "p99_ms": percentile(lags, 99) * 1000,
        "max_ms": max(lags) * 1000,
        "runner_vm_hwm_kib": mem[-1]["vm_hwm_kib"] if mem else None,
    }


def measure(
    deps: Any, settings: Settings, *, rate: float, seconds: float, runs: int, repeats: int
) -> dict[str, Any]:
    rows = [_one(deps, settings, rate=rate, seconds=seconds, runs=runs) for _ in range(repeats)]
    hwm = [r["runner_vm_hwm_kib"] for r in rows if r["runner_vm_hwm_kib"]]
    return {
        "status": "measured",
        "projection": "state",
        "rate_events_per_s": rate,
        "seconds": seconds,
        "runs": runs,
        "sample_interval_ms": SAMPLE_S * 1000,
        "events_per_repeat": summary([r["events"] for r in rows]),
        "p50_ms": summary([r["p50_ms"] for r in rows]),
        "p99_ms": summary([r["p99_ms"] for r in rows]),
        "max_ms": summary([r["max_ms"] for r in rows]),
        "runner_vm_hwm_mib": summary([h / 1024 for h in hwm]) if hwm else None,
    }
