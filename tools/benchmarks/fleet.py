"""``runlog bench fleet``: the worker fleet's targets (docs/concepts/fleet.md).

* ``dispatch``: an idle fleet; ``runlog.start`` to the agent's first event (its
  RUN_STARTED), one start at a time: p50 and p99, after one start timed apart (a
  process's first, which also makes its producer and connections).
* ``failover``: one worker holds N open runs (each appending every 0.5 s); a second worker
  joins, then the first is SIGKILLed. For every run, the time from the kill to its next
  event written by another worker; p99 against the bound lease TTL + session timeout + 2 s.
* ``steps``: R runs x S irreversible tool calls of an async agent on one worker: durable
  steps per second, from the first start to the last finish; ``steps_fleet`` the same on a
  fleet of two workers sharing the runs by partition. The R requests go at once
  (``runlog.aio.start``), as ``one_process`` opens its runs at once.
* ``one_process``: the same R runs x S irreversible calls without the fleet, in this
  process's one event loop (``runlog.aio``), from the first open to the last finish: the
  figure the fleet's is set beside, in the same sitting.

Workers are real `runlog worker` processes on scratch topics (deleted afterwards).
"""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from runlog._api import start
from runlog._settings import Settings
from runlog.fleet import _lifecycle as lifecycle
from runlog.log._kafka import reader_config
from runlog.log._reader import LogReader
from runlog.log._registry import ids_for
from runlog.projections._run_state import RunState, apply, fold
from runlog.schemas import _codec as codec
from runlog.schemas._codec import decode
from runlog.schemas._keys import new_run_id
from runlog.schemas._models import Event, RunFinished
from runlog.schemas._vocabulary import EventType
from tools.benchmarks.common import Scratch, worker_env

TENANT = "bench"


def pct(values: list[float], q: float) -> float:
    vals = sorted(values)
    if not vals:
        return float("nan")
    return vals[min(len(vals) - 1, max(0, round(q * (len(vals) - 1))))]


class WorkerProcs:
    def __init__(self, settings: Settings, out: Path) -> None:
        self.settings = settings
        self.out = out
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def spawn(self, name: str, concurrency: int, *, drain_s: float | None = 1) -> str:
        """A worker; ``drain_s`` None: its drain deadline is the setting's default."""
        log = self.out / f"fleet-{name}.log"
        # The log is appended to across sittings: only what this worker writes counts, or
        # an earlier sitting's "caught up" would time this one's startup (imports, the
        # group's join) as dispatch and steps.
        seen = log.stat().st_size if log.exists() else 0
        wid = f"{name}-{os.getpid()}"
        env = worker_env(
            self.settings,
            RUNLOG_WORKER_SESSION_TIMEOUT_MS=str(self.settings.worker_session_timeout_ms),
        )
        self.procs[name] = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "runlog.cli",
                "worker",
                "--agents",
                "tools.benchmarks.fleet_agents",
                "--concurrency",
                str(concurrency),
                "--id",
                wid,
                *([] if drain_s is None else ["--drain-s", str(drain_s)]),
            ],
            env=env,
            stdout=log.open("ab"),
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while b"caught up" not in log.read_bytes()[seen:]:
            if self.procs[name].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker {name} did not start: {log.read_text()[-2000:]}")
            time.sleep(0.05)
        return wid

    def kill(self, name: str) -> float:
        t = time.time()
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait(10)
        return t

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()


def _events(reader: LogReader, rid: str) -> list[Event]:
    part = reader.partition_of(rid)
    return [r.event for r in reader.read(rid, partition=part, start=0)]


class Follower:
    """The bench's observer: one consumer on every partition of the events topic, read once
    from the beginning and then followed, each record decoded once.

    Re-reading each run from its partition's beginning every poll (``_events``) costs the
    broker and this process a fetch per run per poll, growing with every event written:
    on a machine of two cores that is CPU taken from the worker being measured, and a
    poll of 100 runs took longer than the runs' last second.
    """

    def __init__(self, settings: Settings, only: frozenset[EventType] | None = None) -> None:
        """``only``: decode and fold records of these types alone; the others are counted
        by run and type from their key and type header (``counts``). The steps phase needs
        only each run's finish, and decoding every step's records here is CPU the fleet's
        figure would pay and one process's would not."""
        from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

        self._only = None if only is None else frozenset(t.value.encode() for t in only)
        self.counts: dict[str, Counter[str]] = {}
        """Records per run and type that ``only`` left undecoded."""

        self._consumer = Consumer(reader_config(settings, **{"enable.partition.eof": False}))
        self._consumer.assign(
            [
                TopicPartition(settings.events_topic, p, OFFSET_BEGINNING)
                for p in range(settings.partitions)
            ]
        )
        self._ids = ids_for(settings)
        self.events: dict[str, list[Event]] = {}
        self.states: dict[str, RunState] = {}
        """Each run's state, folded one event at a time as its events arrive (not with
        ``only``)."""

    def poll(self, timeout: float = 0.05) -> set[str]:
        """Read what arrived (waiting up to ``timeout``); the run ids that got events."""
        got: set[str] = set()
        # poll() returns at the first record; consume() would wait for 1000 records or the
        # whole timeout, and the last finish would be seen up to ``timeout`` late (the
        # fleet's clock stops when this sees it, one process's when its tasks return).
        first = self._consumer.poll(timeout)
        batch = [] if first is None else [first, *self._consumer.consume(1000, timeout=0)]
        for msg in batch:
            if msg.error() is not None:
                continue
            if self._only is not None:
                kind = dict(msg.headers() or []).get(codec.H_TYPE)
                if kind not in self._only:
                    key = msg.key() or b""
                    rid = key.decode() if isinstance(key, bytes) else key
                    name = kind.decode() if isinstance(kind, bytes) else str(kind)
                    self.counts.setdefault(rid, Counter())[name] += 1
                    continue
            ev = decode(msg.value() or b"", self._ids)
            self.events.setdefault(ev.run_id, []).append(ev)
            if self._only is None:  # a fold needs every record
                apply(self.states.setdefault(ev.run_id, fold([])), ev)
            got.add(ev.run_id)
        return got

    def close(self) -> None:
        self._consumer.close()


def wait_until(
    settings: Settings,
    rids: list[str],
    done: Any,
    timeout: float,
    follower: Follower | None = None,
) -> dict[str, RunState]:
    """Until ``done(state)`` of every run; ``follower``: one already following (closed here)."""
    deadline = time.monotonic() + timeout
    follower = follower or Follower(settings)
    try:
        got = {rid: fold([]) for rid in rids}
        while True:
            for rid in follower.poll() & got.keys():
                got[rid] = follower.states[rid]
            if all(done(st) for st in got.values()):
                return got
            if time.monotonic() > deadline:
                left = sum(not done(st) for st in got.values())
                raise RuntimeError(f"{left} of {len(rids)} runs not there after {timeout:.0f}s")
    finally:
        follower.close()


def _finishes(follower: Follower, rids: list[str], timeout: float) -> dict[str, str]:
    """Each run's outcome, once its RUN_FINISHED arrived (``follower`` closed here)."""
    deadline = time.monotonic() + timeout
    wanted, out = set(rids), dict[str, str]()
    try:
        while len(out) < len(wanted):
            for rid in follower.poll() & wanted:
                for ev in follower.events[rid]:  # its finish: the only record decoded
                    if isinstance(ev.payload, RunFinished):
                        out[rid] = ev.payload.outcome
            if time.monotonic() > deadline:
                left, of = len(wanted) - len(out), len(wanted)
                raise RuntimeError(f"{left} of {of} runs not finished after {timeout:.0f}s")
    finally:
        follower.close()
    return out


def dispatch(settings: Settings, out: Path, n: int) -> dict[str, Any]:
    workers = WorkerProcs(settings, out)
    try:
        workers.spawn("idle", 8)
        lat: list[float] = []
        with LogReader(settings) as reader:
            # The first start of a process (and the first dispatch of a worker) also makes
            # the producer (its idempotent id), the reader and their connections: timed and
            # reported apart, not mixed into the idle fleet's percentiles.
            for _ in range(n + 1):
                t0 = codec.now_utc()
                rid = start("bench.first", None, tenant=TENANT, settings=settings)
                deadline = time.monotonic() + 30
                while True:
                    evs = _events(reader, rid)
                    if evs:
                        lat.append((evs[0].occurred_at - t0).total_seconds() * 1000)
                        break
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"run {rid} never started")
                    time.sleep(0.002)
                time.sleep(0.05)  # idle again
    finally:
        workers.stop()
    first, lat = lat[0], lat[1:]
    return {
        "starts": n,
        "first_ms": first,
        "p50_ms": statistics.median(lat),
        "p99_ms": pct(lat, 0.99),
        "max_ms": max(lat),
    }


def failover(settings: Settings, out: Path, n: int) -> dict[str, Any]:
    workers = WorkerProcs(settings, out)
    try:
        victim = workers.spawn("holder", n + 10)
        order = {"steps": 10_000, "every_s": 0.5, "until": time.time() + 120}
        rids = [start("bench.hold", order, tenant=TENANT, settings=settings) for _ in range(n)]
        wait_until(settings, rids, lambda st: st.seq >= 2, 120)
        workers.spawn("heir", n + 10)  # takes partitions; the holder keeps its leases
        time.sleep(1.0)
        killed_at = time.time()
        workers.kill("holder")
        bound_s = (settings.lease_ttl_ms + settings.worker_session_timeout_ms) / 1000 + 2
        deadline = time.monotonic() + bound_s + 60
        after: dict[str, float] = {}
        follower = Follower(settings)
        try:
            while len(after) < n and time.monotonic() < deadline:
                for rid in follower.poll(0.2) - after.keys():
                    for ev in follower.events[rid]:
                        if not ev.writer_id.startswith(victim) and ev.seq > 1:
                            after[rid] = ev.occurred_at.timestamp() - killed_at
                            break
        finally:
            follower.close()
    finally:
        workers.stop()
    lat = list(after.values())
    return {
        "runs": n,
        "resumed": len(after),
        "p50_s": statistics.median(lat) if lat else float("nan"),
        "p99_s": pct(lat, 0.99),
        "max_s": max(lat) if lat else float("nan"),
        "bound_s": bound_s,
        "lease_ttl_ms": settings.lease_ttl_ms,
        "session_timeout_ms": settings.worker_session_timeout_ms,
    }


async def _start_all(settings: Settings, agent: str, order: Any, n: int) -> list[str]:
    from runlog import aio

    return list(
        await asyncio.gather(
            *(aio.start(agent, order, tenant=TENANT, settings=settings) for _ in range(n))
        )
    )


def steps(
    settings: Settings, out: Path, runs: int, per_run: int, n_workers: int = 1
) -> dict[str, Any]:
    workers = WorkerProcs(settings, out)
    try:
        for i in range(n_workers):
            # Each new worker's "caught up" comes once the group gave it its partitions
            # (the ones before revoked them first, cooperatively): then the fleet is set.
            workers.spawn("steps" if i == 0 else f"steps-{i + 1}", runs)
        # This process's requests go through one producer, made and warmed here as
        # ``one_process`` warms its clients before its clock starts: a fresh idempotent
        # producer's first acknowledgement can wait ~0.5 s for its producer id. A tombstone
        # of a run id nobody has is a write no worker acts on.
        lifecycle.writer_for(settings).write(new_run_id(), None)
        # The observer too: its consumer's connections and first fetch are its own cost,
        # not the fleet's (one process awaits its runs and needs none).
        follower = Follower(settings, only=frozenset({EventType.RUN_FINISHED}))
        follower.poll(0.5)
        t0 = time.monotonic()
        # The requests go at once, as ``one_process`` opens its runs at once: each
        # ``runlog.aio.start`` returns when the broker acknowledged it, and the ones in
        # flight together share the producer's round trips.
        rids = asyncio.run(_start_all(settings, "bench.steps", {"steps": per_run}, runs))
        outcomes = _finishes(follower, rids, 600)
        elapsed = time.monotonic() - t0
    finally:
        workers.stop()
    # Every run's steps, from their records' type headers (a partition's records arrive in
    # order: all of a run's were counted before its finish was seen).
    calls = EventType.TOOL_CALL_COMPLETED.value
    ok = sum(
        outcomes[rid] == "succeeded" and follower.counts.get(rid, Counter())[calls] == per_run
        for rid in rids
    )
    return {
        "runs": runs,
        "workers": n_workers,
        "steps_per_run": per_run,
        "succeeded": ok,
        "seconds": elapsed,
        "steps_per_s": runs * per_run / elapsed,
    }


def one_process(settings: Settings, runs: int, per_run: int) -> dict[str, Any]:
    from runlog._bootstrap import Services
    from runlog.log._clients import async_redis_client
    from runlog.producers._async_run import open_async
    from tools.benchmarks.fleet_agents import step

    services = Services(settings)
    deps = services.run_deps()

    async def one(aredis: Any, steps: int = per_run) -> None:
        run = await open_async(deps, aredis, None, tenant=TENANT, tools=[step])
        for i in range(steps):
            await run.call_tool("step", {"i": i})
        await run.finish("succeeded", "done")
        await run.close()

    async def main() -> float:
        aredis = async_redis_client(settings)
        # One run before the clock starts, as the fleet's worker is warm before it says
        # ready: the producer's id, the schemas' encoders, the pools' threads and sockets.
        await one(aredis, 1)
        t0 = time.monotonic()
        await asyncio.gather(*(one(aredis) for _ in range(runs)))
        elapsed = time.monotonic() - t0
        await aredis.aclose()
        return elapsed

    try:
        elapsed = asyncio.run(main())
    finally:
        services.close()
    return {
        "runs": runs,
        "steps_per_run": per_run,
        "seconds": elapsed,
        "steps_per_s": runs * per_run / elapsed,
    }


STEP_PHASES = ("steps", "steps_fleet", "one_process")
"""Measured in rounds, each round all three in turn on fresh topics: the machine's load
moves between minutes, so each fleet figure is set beside the one-process figure of its
own round, and the report gives every round's ratio and their median."""


def run(
    base: Settings,
    *,
    out: Path,
    starts: int = 50,
    held: int = 200,
    runs: int = 100,
    per_run: int = 20,
    rounds: int = 5,
    lease_ttl_ms: int = 3000,
    session_timeout_ms: int = 6000,
) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {}
    phases: list[tuple[str, Any]] = [
        ("dispatch", lambda s: dispatch(s, out, starts)),
        ("failover", lambda s: failover(s, out, held)),
    ]
    for _ in range(rounds):
        phases += [
            ("steps", lambda s: steps(s, out, runs, per_run)),
            ("steps_fleet", lambda s: steps(s, out, runs, per_run, n_workers=2)),
            ("one_process", lambda s: one_process(s, runs, per_run)),
        ]
    for name, phase in phases:  # each on topics of its own: no run of one is left to another
        scratch = Scratch.create(
            base, lease_ttl_ms=lease_ttl_ms, worker_session_timeout_ms=session_timeout_ms
        )
        try:
            got = phase(scratch.settings)
        finally:
            scratch.cleanup()
        if name in STEP_PHASES:
            res.setdefault(name, []).append(got)
        else:
            res[name] = got
    return res


def _steps_line(label: str, mine: list[dict[str, Any]], one: list[dict[str, Any]]) -> str:
    rates = [m["steps_per_s"] for m in mine]
    ratios = [m["steps_per_s"] / o["steps_per_s"] for m, o in zip(mine, one, strict=True)]
    ok, of = min(m["succeeded"] for m in mine), mine[0]["runs"]
    told = f"all {of} succeeded" if ok == of else f"ONLY {ok} of {of} succeeded in a round"
    return (
        f"{label}: {statistics.median(rates):.0f} durable steps/s (median of "
        f"{', '.join(f'{r:.0f}' for r in rates)}; {told}); "
        f"x one process of the same round: {', '.join(f'{r:.2f}' for r in ratios)} "
        f"(median {statistics.median(ratios):.2f})"
    )


def report(res: dict[str, Any]) -> str:
    d, f, one = res["dispatch"], res["failover"], res["one_process"]
    st, two = res["steps"], res["steps_fleet"]
    shape = f"{st[0]['runs']} runs x {st[0]['steps_per_run']} irreversible steps"
    ones = [o["steps_per_s"] for o in one]
    return "\n".join(
        [
            f"dispatch (idle fleet, {d['starts']} starts): start -> RUN_STARTED "
            f"p50 {d['p50_ms']:.1f} ms, p99 {d['p99_ms']:.1f} ms, max {d['max_ms']:.1f} ms "
            f"(targets 50 / 250 ms); a process's first start {d['first_ms']:.0f} ms",
            f"failover ({f['runs']} open runs, SIGKILL): {f['resumed']} resumed by another "
            f"worker; kill -> next event p50 {f['p50_s']:.2f} s, p99 {f['p99_s']:.2f} s, "
            f"max {f['max_s']:.2f} s; bound TTL {f['lease_ttl_ms']} ms + session "
            f"{f['session_timeout_ms']} ms + 2 s = {f['bound_s']:.1f} s",
            _steps_line(f"steps ({shape}, one worker)", st, one),
            _steps_line(f"steps ({shape}, a fleet of {two[0]['workers']} workers)", two, one),
            f"one process ({shape}, one event loop, no fleet): "
            f"{statistics.median(ones):.0f} durable steps/s (median of "
            f"{', '.join(f'{r:.0f}' for r in ones)})",
        ]
    )
