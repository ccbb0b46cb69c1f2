"""6. Memory: peak RSS (``VmHWM``) of a worker process holding many open runs.

Each figure is a fresh subprocess (``tools.benchmarks.worker hold N E``): the shared producer,
the lease renewer and N open runs with E appended events each. N=0 is the baseline (the
interpreter, runlog, librdkafka and the two clients). Runs are opened T at a time and every
``open_run`` creates (and closes) its own replay consumer, so the peak includes T transient
librdkafka consumers; the RSS after opening (steady state) is reported beside it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from runlog._settings import Settings
from tools.benchmarks.common import summary, worker_env

HOLD_LIVENESS_TTL_MS = 30_000
"""The holder's session lives this long without a renewal (its runs stay its own)."""


def _hold(settings: Settings, runs: int, events: int, threads: int) -> dict[str, Any]:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.benchmarks.worker",
            "hold",
            str(runs),
            str(events),
            str(threads),
        ],
        # What is measured is memory: a stall of a loaded machine longer than the default
        # liveness TTL (2 s) would fence the holder mid-measurement, so it lives longer.
        env=worker_env(settings, RUNLOG_LIVENESS_TTL_MS=str(HOLD_LIVENESS_TTL_MS)),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"memory worker failed (rc={done.returncode}): {done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def measure(
    settings: Settings, *, runs: int, events: int, threads: int, repeats: int
) -> dict[str, Any]:
    base: list[float] = []
    held: list[float] = []
    rss: list[float] = []
    thread_counts: list[float] = []
    for _ in range(repeats):
        b = _hold(settings, 0, 0, threads)
        h = _hold(settings, runs, events, threads)
        base.append(b["vm_hwm_kib"] / 1024)
        held.append(h["vm_hwm_kib"] / 1024)
        rss.append(h["vm_rss_kib"] / 1024)
        thread_counts.append(h["threads"])
    return {
        "runs": runs,
        "events_per_run": events,
        "open_threads": threads,
        "baseline_vm_hwm_mib": summary(base),
        "worker_vm_hwm_mib": summary(held),
        "worker_vm_rss_after_mib": summary(rss),
        "per_run_peak_kib": summary(
            [(h - b) * 1024 / runs for h, b in zip(held, base, strict=True)]
        ),
        "per_run_steady_kib": summary(
            [(a - b) * 1024 / runs for a, b in zip(rss, base, strict=True)]
        ),
        "python_threads": summary(thread_counts),
    }
