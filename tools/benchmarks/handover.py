"""``runlog bench handover``: a drained worker's handover and a dead worker's failover.

* ``sigterm``: one worker runs N runs of ``bench.pay`` (irreversible calls in flight
  ``step_s`` each), either mid-step (no sleep) or mid-sleep (a durable sleep after each
  call); a second worker is ready. SIGTERM the first (and, in the second variant, SIGKILL
  it 2 s later, as Kubernetes does at the end of a short grace): for every run, the time
  from the SIGTERM (for a sleeping run: from its due time, when that is later) to its next
  event written by the other worker. Then every effect's count at the receiver: doubled
  (more than once) and lost (never) must be 0.
* ``sigkill``: one worker holds N open runs (``bench.hold``, idle between appends); the
  Redis commands per second while it holds them (``INFO commandstats`` deltas: the
  liveness traffic, which must not grow with N), then a second worker joins and the first
  is SIGKILLed: kill to each run's next event on the other worker.

Real `runlog worker` processes on scratch topics, with default settings; Redis is a
private ``redis-server`` of the bench's own, so the command counts are the fleet's alone.
"""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path
from typing import Any

import redis

from runlog._api import start
from runlog._settings import Settings
from runlog.schemas._models import TimerStarted
from runlog.schemas._vocabulary import EventType
from tools.benchmarks.common import Scratch
from tools.benchmarks.fleet import TENANT, Follower, WorkerProcs, pct, wait_until
from tools.redis_server import PrivateRedis

WINDOW_S = 10.0
"""How long the Redis commands of a worker holding its runs are counted."""


def _commandstats(client: redis.Redis) -> dict[str, int]:
    info = client.info("commandstats")
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in info.items()}


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"n": 0, "p50": float("nan"), "p99": float("nan"), "max": float("nan")}
    return {
        "n": len(values),
        "p50": statistics.median(values),
        "p99": pct(values, 0.99),
        "max": max(values),
    }


def _effects(settings: Settings, expected: int) -> dict[str, int]:
    client = redis.Redis.from_url(settings.redis_url)
    counts = [int(v) for v in client.hgetall(f"{settings.redis_key_prefix}:effects").values()]
    return {"doubled": sum(1 for c in counts if c > 1), "lost": expected - len(counts)}


def sigterm(
    settings: Settings, out: Path, n: int, *, sleep_s: float, kill_after_s: float | None
) -> dict[str, Any]:
    """SIGTERM (then SIGKILL ``kill_after_s`` later, if given) a worker whose ``n`` runs
    are mid-step (``sleep_s`` 0) or mid-sleep."""
    steps, step_s = (30, 0.5) if not sleep_s else (12, 0.2)
    workers = WorkerProcs(settings, out)
    try:
        victim = workers.spawn("drained", n + 10, drain_s=None)
        order = {"steps": steps, "step_s": step_s, "sleep_s": sleep_s}
        rids = [start("bench.pay", order, tenant=TENANT, settings=settings) for _ in range(n)]
        wait_until(settings, rids, lambda st: len(st.completed_calls) >= 2, 180)
        workers.spawn("heir", n + 10)
        time.sleep(1.0)
        follower = Follower(settings)
        follower.poll(0.5)
        term_at = time.time()
        workers.procs["drained"].terminate()
        killer = None
        if kill_after_s is not None:
            killer = threading.Timer(kill_after_s, workers.procs["drained"].kill)
            killer.start()
        after: dict[str, float] = {}
        finished: set[str] = set()
        deadline = time.monotonic() + 240
        try:
            while len(finished) < n and time.monotonic() < deadline:
                for rid in follower.poll(0.2):
                    evs = follower.events[rid]
                    if any(e.type is EventType.RUN_FINISHED for e in evs):
                        finished.add(rid)
                    if rid in after:
                        continue
                    nxt = next(
                        (
                            e
                            for e in evs
                            if e.occurred_at.timestamp() > term_at
                            and not e.writer_id.startswith(victim)
                        ),
                        None,
                    )
                    if nxt is None:
                        continue
                    before = [e for e in evs if e.occurred_at.timestamp() <= term_at]
                    due = term_at
                    timers = [e.payload for e in before if isinstance(e.payload, TimerStarted)]
                    if timers and sleep_s:
                        due = max(due, timers[-1].due_at.timestamp())
                    after[rid] = max(0.0, nxt.occurred_at.timestamp() - due)
        finally:
            follower.close()
            if killer is not None:
                killer.join()
    finally:
        workers.stop()
    return {
        "runs": n,
        "sleep_s": sleep_s,
        "kill_after_s": kill_after_s,
        "next_event_s": _stats(list(after.values())),
        "finished": len(finished),
        **_effects(settings, n * steps),
    }


def sigkill(settings: Settings, out: Path, n: int) -> dict[str, Any]:
    """A worker holding ``n`` open runs: its Redis commands per second, then SIGKILL."""
    workers = WorkerProcs(settings, out)
    client = redis.Redis.from_url(settings.redis_url)
    try:
        victim = workers.spawn("holder", n + 10)
        order = {"steps": 10_000, "every_s": 3600, "until": time.time() + 3600}
        rids = [start("bench.hold", order, tenant=TENANT, settings=settings) for _ in range(n)]
        wait_until(settings, rids, lambda st: st.seq >= 2, 600)
        time.sleep(2.0)
        first, t0 = _commandstats(client), time.monotonic()
        time.sleep(WINDOW_S)
        last, took = _commandstats(client), time.monotonic() - t0
        delta = {k: (last.get(k, 0) - first.get(k, 0)) / took for k in last}
        workers.spawn("heir", n + 10)
        time.sleep(1.0)
        follower = Follower(settings)
        follower.poll(0.5)
        killed_at = workers.kill("holder")
        after: dict[str, float] = {}
        deadline = time.monotonic() + 120
        try:
            while len(after) < n and time.monotonic() < deadline:
                for rid in follower.poll(0.2) - after.keys():
                    for ev in follower.events[rid]:
                        if ev.occurred_at.timestamp() > killed_at and not ev.writer_id.startswith(
                            victim
                        ):
                            after[rid] = ev.occurred_at.timestamp() - killed_at
                            break
        finally:
            follower.close()
    finally:
        workers.stop()
    busiest = sorted(((v, k) for k, v in delta.items() if v > 0), reverse=True)[:6]
    return {
        "runs": n,
        "resumed": len(after),
        "failover_s": _stats(list(after.values())),
        "redis_ops_per_s": sum(delta.values()),
        "busiest": {k: round(v, 1) for v, k in busiest},
    }


def run(base: Settings, *, out: Path, held: int = 200, many: int = 2000) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    private = PrivateRedis()
    res: dict[str, Any] = {"sigterm": [], "sigkill": []}
    try:
        plans: list[tuple[str, Any]] = [
            ("sigterm", lambda s: sigterm(s, out, held, sleep_s=0, kill_after_s=None)),
            ("sigterm", lambda s: sigterm(s, out, held, sleep_s=0, kill_after_s=2.0)),
            ("sigterm", lambda s: sigterm(s, out, held, sleep_s=1.0, kill_after_s=None)),
            ("sigterm", lambda s: sigterm(s, out, held, sleep_s=1.0, kill_after_s=2.0)),
            ("sigkill", lambda s: sigkill(s, out, held)),
            ("sigkill", lambda s: sigkill(s, out, many)),
        ]
        for name, plan in plans:
            # Default settings but the stack's address: each plan on topics of its own.
            scratch = Scratch.create(base, redis_url=private.url)
            try:
                res[name].append(plan(scratch.settings))
            finally:
                scratch.cleanup()
    finally:
        private.stop()
    return res


def _line(label: str, s: dict[str, float]) -> str:
    return (
        f"{label}: p50 {s['p50']:.2f} s, p99 {s['p99']:.2f} s, max {s['max']:.2f} s "
        f"(n={s['n']:.0f})"
    )


def report(res: dict[str, Any]) -> str:
    lines = []
    for r in res["sigterm"]:
        what = "mid-sleep (from the due time when later)" if r["sleep_s"] else "mid-step"
        kill = "never" if r["kill_after_s"] is None else f"{r['kill_after_s']:.0f} s after"
        lines.append(
            _line(
                f"SIGTERM, {r['runs']} runs {what}, SIGKILL {kill}: next event on the other worker",
                r["next_event_s"],
            )
            + f"; {r['finished']} finished, effects doubled {r['doubled']}, lost {r['lost']}"
        )
    for r in res["sigkill"]:
        lines.append(
            _line(
                f"SIGKILL failover, {r['runs']} open runs: next event on the other worker",
                r["failover_s"],
            )
            + f"; {r['resumed']} resumed"
        )
        lines.append(
            f"Redis commands while one worker holds {r['runs']} open runs: "
            f"{r['redis_ops_per_s']:.1f}/s (busiest: {r['busiest']})"
        )
    return "\n".join(lines)
