"""4. Recovery: from a worker's death to its successor's first durable append.

A worker subprocess (``tools.benchmarks.worker append``) owns a run and appends every 10 ms.

* ``expiry``: SIGKILL. The lease stays in Redis until its TTL runs out; the successor
  (this process) calls ``open_run`` at once and waits for it, replays, claims, appends.
* ``takeover``: SIGKILL, and the successor, knowing the owner is dead, calls
  ``open_run(run_id, takeover=True)``: the lease is broken at once with a higher epoch.
* ``release``: the graceful path: SIGTERM makes the worker ``close()`` the run (which
  releases the lease); the successor starts at the same instant and polls until it is free.

All are timed from the signal to the successor's first acknowledged append.

Then the cost of resuming a long run: ``open_run`` of a closed N-event run (replay from
its first offset, or from a snapshot plus the tail when ``runlog.log._snapshots`` exists),
against ``open_run`` of a new run (the fixed cost every open pays).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

from runlog._bootstrap import Services
from runlog._settings import Settings
from runlog.producers._handle import engine_of
from runlog.producers._opening import open_run_with
from runlog.schemas._keys import live_key, session_of
from tools.benchmarks.common import TENANT, Scratch, summary, worker_env, workload_payload

SNAPSHOT_INTERVAL = 500
"""A typical interval for long runs: one snapshot per 500 events."""


def _spawn_worker(settings: Settings, run_id: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tools.benchmarks.worker", "append", run_id, "0.01"],
        env=worker_env(settings),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + 120
    appended = 0
    while appended < 5:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"benchmark worker exited early (rc={proc.wait()})")
        if line.startswith("seq "):
            appended += 1
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("benchmark worker did not start appending within 120 s")
    return proc


def _new_run(deps: Any) -> str:

    with open_run_with(deps, None, tenant=TENANT, recover=False) as run:
        et, payload = workload_payload(run.state.seq + 1)
        run.append(et, payload)
        return str(run.run_id)


def _lease_ttl_ms(deps: Any, run_id: str) -> int:
    """How long the run's lease lives unless renewed: its own TTL, or, for a lease bound to
    its process's session, the TTL left on that session's liveness key."""
    leases = deps.leases
    key = leases.lease_key(TENANT, run_id)
    pttl = int(deps.redis.pttl(key))
    if pttl >= 0:
        return pttl
    value = deps.redis.get(key)
    session = session_of(value.decode()) if value is not None else None
    if session is None:
        return pttl
    return int(deps.redis.pttl(live_key(leases.prefix, session)))


def _handoff(deps: Any, settings: Settings, how: str) -> dict[str, float]:

    run_id = _new_run(deps)
    proc = _spawn_worker(settings, run_id)
    pttl = _lease_ttl_ms(deps, run_id)
    t0 = time.perf_counter()
    os.kill(proc.pid, signal.SIGTERM if how == "release" else signal.SIGKILL)
    if how == "takeover":
        proc.wait(timeout=30)  # the supervisor knows the owner is dead: its exit is seen
    run = open_run_with(
        deps,
        run_id,
        tenant=TENANT,
        wait_s=settings.lease_ttl_ms / 1000 + 30,
        takeover=how == "takeover",
    )
    t_open = time.perf_counter() - t0
    try:
        et, payload = workload_payload(run.state.seq + 1)
        run.append(et, payload)
        total = time.perf_counter() - t0
    finally:
        run.close()
        proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()
    return {"total_s": total, "open_s": t_open, "lease_pttl_at_signal_s": pttl / 1000}


def _write_long_run(deps: Any, n: int, store: Any) -> tuple[str, list[float], int]:
    """A closed run of ``n`` events written through runlog.

    Returns its id, the snapshot write times (s) and the seq of the last snapshot.
    """

    snap_times: list[float] = []
    last_snap = 0
    with open_run_with(deps, None, tenant=TENANT, recover=False) as run:
        while run.state.seq < n:
            for _ in range(min(100, n - run.state.seq)):
                et, payload = workload_payload(run.state.seq + 1)
                run.emit(et, payload)
            run.barrier()
            if store is not None:
                t0 = time.perf_counter()
                if store.maybe_write(engine_of(run)):
                    snap_times.append(time.perf_counter() - t0)
                    last_snap = run.state.seq
        return str(run.run_id), snap_times, last_snap


def _resume(deps: Any, run_id: str | None) -> float:

    t0 = time.perf_counter()
    run = open_run_with(deps, run_id, tenant=TENANT)
    elapsed = time.perf_counter() - t0
    run.close()
    return elapsed


def measure(
    deps: Any, base: Settings, *, ttl_ms: int, resume_events: int, repeats: int
) -> dict[str, Any]:

    out: dict[str, Any] = {"lease_ttl_ms": ttl_ms, "handoff": {}, "resume": {}}
    # Handoff on its own topics, with a short TTL so expiry is measurable.
    scratch = Scratch.create(base, lease_ttl_ms=ttl_ms)
    services = Services(scratch.settings)
    try:
        hdeps = services.run_deps()
        modes = ("expiry", "takeover", "release")
        per: dict[str, list[dict[str, float]]] = {how: [] for how in modes}
        for r in range(repeats):
            for how in modes if r % 2 == 0 else tuple(reversed(modes)):
                per[how].append(_handoff(hdeps, scratch.settings, how))
        for how, rows in per.items():
            out["handoff"][how] = {
                k: summary([row[k] for row in rows])
                for k in ("total_s", "open_s", "lease_pttl_at_signal_s")
            }
    finally:
        services.close()
        scratch.cleanup()
    # Resume a long run without a snapshot (the deps given) and, if shipped, with one.
    n = resume_events
    out["resume"]["events"] = n
    run_id, _, _ = _write_long_run(deps, n, None)
    new_runs = [_resume(deps, None) for _ in range(repeats)]
    full = [_resume(deps, run_id) for _ in range(repeats)]
    out["resume"]["new_run_open_s"] = summary(new_runs)
    out["resume"]["without_snapshot_s"] = summary(full)
    snap_settings = deps.settings.model_copy(update={"snapshot_interval": SNAPSHOT_INTERVAL})
    snap_services = Services(snap_settings)
    try:
        sdeps = snap_services.run_deps()
        if sdeps.snapshots is None:
            out["resume"]["with_snapshot"] = (
                "snapshot store unavailable (RUNLOG_SNAPSHOT_INTERVAL is 0)"
            )
            return out
        snap_run, snap_times, last_snap = _write_long_run(sdeps, n, sdeps.snapshots)
        with_snap = [_resume(sdeps, snap_run) for _ in range(repeats)]
        out["resume"]["with_snapshot_s"] = summary(with_snap)
        out["resume"]["snapshot_interval"] = SNAPSHOT_INTERVAL
        out["resume"]["snapshot_writes"] = len(snap_times)
        out["resume"]["tail_events_after_snapshot"] = n - last_snap
        if snap_times:
            out["resume"]["snapshot_write_s"] = summary(snap_times)
    finally:
        snap_services.close()
    return out
