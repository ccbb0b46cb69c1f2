"""Subprocesses of the benchmarks (settings come from ``RUNLOG_*`` in the environment).

    python -m tools.benchmarks.worker append RUN_ID   resume RUN_ID, append until signalled
    python -m tools.benchmarks.worker hold N E T      open N runs (T at a time), E events each,
                                                report memory
    python -m tools.benchmarks.worker project [P,..]  run projections (default state) until SIGTERM

``append`` prints ``ready`` once it owns the run, ``seq S`` after every acknowledged
append; SIGTERM makes it close the run (releasing the lease) and exit: the graceful
handoff. SIGKILL is the crash. ``hold`` prints one JSON line with VmHWM / VmRSS; ``project``
prints the same when it stops.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from typing import Any

from runlog._bootstrap import Services
from runlog._settings import Settings
from runlog.consumers.runner import ProjectionRunner, streaming_gc
from runlog.log._clients import redis_client
from runlog.producers._opening import open_run_with
from tools.benchmarks.common import TENANT, workload_payload
from tools.benchmarks.throughput import open_many


def _status_kib(field: str) -> int:
    with open("/proc/self/status", encoding="utf-8") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _deps() -> Any:

    return Services(Settings()).run_deps()


def append(run_id: str, interval_s: float) -> int:

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    deps = _deps()
    run = open_run_with(deps, run_id, tenant=TENANT, wait_s=60)
    print("ready", flush=True)
    try:
        while not stop.is_set():
            et, payload = workload_payload(run.state.seq + 1)
            run.append(et, payload)
            print(f"seq {run.state.seq}", flush=True)
            stop.wait(interval_s)
    finally:
        run.close()
    print(f"closed {time.time():.6f}", flush=True)
    return 0


def hold(runs: int, events: int, threads: int) -> int:

    baseline_kib = _status_kib("VmHWM")
    deps = _deps()
    deps.writer  # noqa: B018 - the shared producer exists even with no runs
    opened, _ = open_many(deps, runs, threads) if runs else ([], [])
    for _ in range(events):
        for run in opened:
            et, payload = workload_payload(run.state.seq + 1)
            run.emit(et, payload)
        for run in opened:
            run.barrier()
    time.sleep(0.5)  # let background threads (renewal, poller) settle
    out = {
        "runs": runs,
        "events_per_run": events,
        "vm_hwm_kib": _status_kib("VmHWM"),
        "vm_rss_kib": _status_kib("VmRSS"),
        "imports_hwm_kib": baseline_kib,
        "threads": threading.active_count(),
    }
    print(json.dumps(out), flush=True)
    for run in opened:
        run.close()
    return 0


def project(names: list[str]) -> int:

    streaming_gc()
    settings = Settings()
    client = redis_client(settings)
    runner = ProjectionRunner(settings, client, names)
    signal.signal(signal.SIGTERM, lambda *_: runner.stop())
    try:
        runner.run()
    finally:
        client.close()
    out = {"vm_hwm_kib": _status_kib("VmHWM"), "vm_rss_kib": _status_kib("VmRSS")}
    print(json.dumps(out), flush=True)
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["append"]:
        return append(argv[1], float(argv[2]) if len(argv) > 2 else 0.01)
    if argv[:1] == ["hold"]:
        return hold(int(argv[1]), int(argv[2]), int(argv[3]))
    if argv[:1] == ["project"]:
        return project(argv[1].split(",") if len(argv) > 1 else ["state"])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
