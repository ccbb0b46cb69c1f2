"""In-process counters, gauges and timings (replay jobs, snapshots).

RECONSTRUCTED: the projections work (issue #4) accidentally overwrote this file while it
was still uncommitted; this is a minimal stand-in with the functions ``consumers.replay``
calls (``incr``, ``gauge``, ``timing``). Its owner should replace it with the original.
"""

from __future__ import annotations

import threading
from typing import Any

_lock = threading.Lock()
_counters: dict[str, float] = {}
_gauges: dict[str, float] = {}
_timings: dict[str, list[float]] = {}


def incr(name: str, value: float = 1) -> None:
    with _lock:
        _counters[name] = _counters.get(name, 0) + value


def gauge(name: str, value: float) -> None:
    with _lock:
        _gauges[name] = value


def timing(name: str, ms: float) -> None:
    with _lock:
        _timings.setdefault(name, []).append(ms)


def snapshot() -> dict[str, Any]:
    with _lock:
        return {
            "counters": dict(_counters),
            "gauges": dict(_gauges),
            "timings": {k: list(v) for k, v in _timings.items()},
        }


def reset() -> None:
    with _lock:
        _counters.clear()
        _gauges.clear()
        _timings.clear()
