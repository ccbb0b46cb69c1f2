"""Process-wide replay and snapshot metrics, printed by ``--json`` outputs.

Projection metrics live in ``consumers._projection_metrics``. A plain dict behind a lock:
enough for a CLI and tests, and easy to export later. Counters add up; ``*_ms`` timings
keep the last value plus a ``_total`` and ``_count``; gauges keep the last value.
"""

from __future__ import annotations

import threading
from typing import Any

_LOCK = threading.Lock()
_METRICS: dict[str, float] = {}

COUNTERS = (
    "events_replayed",
    "snapshot_loads",
    "snapshot_misses",
    "snapshot_writes",
    "snapshot_discontinuities",
    "snapshot_live_divergences",
    "full_replay_equivalence_failures",
)
TIMINGS = ("replay_duration_ms", "snapshot_load_ms", "snapshot_write_ms")
GAUGES = ("snapshot_seq_gap",)
"""Events between the snapshot used and the head of the run: what the tail replayed."""


def incr(name: str, by: float = 1) -> None:
    with _LOCK:
        _METRICS[name] = _METRICS.get(name, 0) + by


def timing(name: str, ms: float) -> None:
    """Record one duration: ``name`` keeps the last, ``name_total`` and ``name_count`` add."""
    with _LOCK:
        _METRICS[name] = ms
        _METRICS[f"{name}_total"] = _METRICS.get(f"{name}_total", 0) + ms
        _METRICS[f"{name}_count"] = _METRICS.get(f"{name}_count", 0) + 1


def gauge(name: str, value: float) -> None:
    with _LOCK:
        _METRICS[name] = value


def snapshot() -> dict[str, Any]:
    """A copy of every metric, with the known names present (0 if never touched)."""
    with _LOCK:
        out: dict[str, Any] = {n: 0 for n in (*COUNTERS, *TIMINGS, *GAUGES)}
        out.update(_METRICS)
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in sorted(out.items())}


def reset() -> None:
    with _LOCK:
        _METRICS.clear()
