"""Delay: a worker whose link to Redis adds 500 ms each way (tests/faults/delayproxy.py).

The kernel has no netem, so the delay is a proxy between the worker process and the fault
cluster's Redis (Kafka is reached directly). A renewal then takes a second, close to the
lease's local validity (0.8 of a 1.5 s TTL from the renewal's start). A worker that stops
with a clear error is replaced, as a supervisor would; the run must finish with every
acknowledged append valid, no event twice, no two owners, each effect once and recorded.
(With a 1.2 s TTL every worker was fenced before it finished, eight in a row: a lease
whose TTL is near the round trip cannot be held, which is safe but not live.)

Reproduce: ``.venv/bin/python -m pytest tests/faults -k delay`` (seed ``SEED``).
"""

from __future__ import annotations

import random
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from delayproxy import DelayProxy
from faultkit import FaultReport
from netns_worker import EXIT_CLEAR, EXIT_FENCED
from test_network_faults import Episode

from runlog.settings import Settings

SEED = 4208
DELAY_S = 0.5


class _Direct:
    """Starts worker processes in this namespace (the proxy is on 127.0.0.1)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[Any]] = []

    def popen(self, node: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        kwargs.pop("skew_s", None)
        proc = subprocess.Popen(list(argv), start_new_session=True, **kwargs)
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)


def test_delay_500ms_to_redis_keeps_one_owner_and_effects_once(
    healthy: Settings, report: FaultReport, tmp_path: Path
) -> None:
    t0 = time.monotonic()
    rng = random.Random(SEED)
    ttl_ms = 1500
    redis = urlsplit(healthy.redis_url)
    with DelayProxy(redis.port or 6379, DELAY_S) as proxy:
        url = f"redis://127.0.0.1:{proxy.port}{redis.path}"
        slow = healthy.model_copy(update={"redis_url": url, "lease_ttl_ms": ttl_ms})
        direct = _Direct()
        ep = Episode(slow, direct, "w1", SEED, tmp_path)  # type: ignore[arg-type]
        ep.target = 2 + rng.randint(0, 1)
        report.faults[f"delay: {DELAY_S * 1000:.0f} ms each way to Redis, TTL {ttl_ms} ms"] += 1
        codes: list[int] = []
        outs: list[str] = []
        try:
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                name = f"delay-g{len(codes) + 1}"
                proc = ep.spawn(name, hold=False, pace_s=0.05, wait_s=15)
                out, _ = proc.communicate(timeout=120)
                codes.append(proc.returncode)
                outs.append(out)
                ep.load_acks(name)
                assert proc.returncode in (0, EXIT_CLEAR, EXIT_FENCED), out
                if proc.returncode == 0:
                    break
        finally:
            direct.stop()
        chunks = proxy.chunks
    assert codes and codes[-1] == 0, f"the run did not finish: exits {codes}\n{outs[-1]}"
    assert chunks > 0, "nothing went through the proxy"
    ep.settings = healthy
    state, _ = ep.check(report, "delay")
    report.notes.append(
        f"delay {DELAY_S * 1000:.0f} ms to Redis, TTL {ttl_ms} ms, seed {SEED}: "
        f"{len(codes)} worker processes (exits {codes}), {chunks} chunks delayed, "
        f"{len(state.completed_calls)} effects, fenced_writes={state.fenced_writes}"
    )
    report.durations["delay_redis"] = time.monotonic() - t0
