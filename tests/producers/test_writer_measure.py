"""Numbers, not verdicts: durable append latency and takeover time on this stack.

Printed (run with ``-s``), never asserted: they depend on the machine. What is asserted is
that the measured operations did what they claim (durable, valid, one owner).

    .venv/bin/python -m pytest tests/producers/test_writer_measure.py -s -q
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import pytest
from workers.common import assert_log_sound, read_log, start_worker

import runlog
from runlog._settings import Settings
from runlog.schemas._keys import new_run_id
from runlog.schemas._vocabulary import EventType

pytestmark = pytest.mark.timeout(90)

APPENDS = 300
TAKEOVERS = 3


def _pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def test_measure_durable_append_latency(fast: Settings) -> None:
    with runlog.open_run(settings=fast) as run:
        lat = []
        for i in range(APPENDS):
            t = time.perf_counter()
            run.append(EventType.USER_MESSAGE, content=f"message {i}")
            lat.append((time.perf_counter() - t) * 1000)
        t = time.perf_counter()
        for i in range(APPENDS):
            run.emit(EventType.MEMORY_WRITTEN, key=f"k{i}", value="v")
        run.barrier()
        pipelined = (time.perf_counter() - t) * 1000
        run.finish("succeeded")
    state = assert_log_sound([r.event for r in read_log(fast, run.run_id)])
    assert state.seq == 2 * APPENDS + 2 and state.fenced_writes == 0
    print(
        f"\ndurable append (acks=all, idempotent, lease guard + post-ack check), n={APPENDS}: "
        f"p50 {statistics.median(lat):.2f} ms, p99 {_pct(lat, 0.99):.2f} ms, "
        f"max {max(lat):.2f} ms; pipelined {APPENDS} events + one barrier: {pipelined:.1f} ms "
        f"({pipelined / APPENDS:.3f} ms/event)"
    )


def test_measure_takeover_after_sigkill(fast: Settings, tmp_path: Path) -> None:
    """SIGKILL of a live owner -> the successor's first durable append (lease expiry incl.)."""
    claims, firsts = [], []
    for i in range(TAKEOVERS):
        rid = new_run_id()
        owner = start_worker(fast, tmp_path, f"owner{i}", "--run-id", rid, "--scenario", "hold")
        owner.wait_flag("holding")
        owner.kill()
        t0 = time.perf_counter()
        with runlog.open_run(rid, settings=fast, wait_s=10) as run:
            t1 = time.perf_counter()  # RUN_RESUMED is durable and read back
            run.append(EventType.MEMORY_WRITTEN, key="successor", value="1")
            t2 = time.perf_counter()
            assert run.epoch == 2
        claims.append((t1 - t0) * 1000)
        firsts.append((t2 - t0) * 1000)
        events = [r.event for r in read_log(fast, rid)]
        state = assert_log_sound(events)
        assert state.epoch == 2 and state.fenced_writes == 0
    print(
        f"\ntakeover after SIGKILL (lease TTL {fast.lease_ttl_ms} ms): claim durable after "
        f"{', '.join(f'{c:.0f}' for c in claims)} ms; first append after "
        f"{', '.join(f'{f:.0f}' for f in firsts)} ms "
        f"(median {statistics.median(firsts):.0f} ms)"
    )
