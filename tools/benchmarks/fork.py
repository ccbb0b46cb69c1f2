"""``runlog bench fork``: the fork's targets (docs/concepts/forks.md).

* ``latency``: a run of N realistic events (10,000 by default: turns, tool calls,
  compactions, written through the real writer) forked at its last event, one fork at a
  time, each a new run: ``fork_run_with`` from the call to the acknowledged RUN_FORKED
  (reading and folding the parent's log, packing its state, appending the one record).
  p50 and p99 over the repeats, after one fork timed apart (a process's first, which also
  makes its producer and connections). Target: p50 <= 1 s at 10,000 events.
* ``replay``: a fork of that run at its last event, continued to L events of its own, and
  a plain run of exactly L events of the same mix: each replayed from its log (no
  snapshot), alternately, medians and the ratio fork / plain (target <= 1: a fork replays
  its own log only, never its parent's). Also the parent's own replay (N events), which the
  fork's first record stands in for.

On scratch topics (deleted afterwards).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path
from typing import Any

from runlog._bootstrap import Services
from runlog._settings import Settings
from runlog.cli._synthetic import write_synthetic_run
from runlog.log._replay import replay
from runlog.producers._engine import Engine
from runlog.producers._forks import fork_run_with
from runlog.producers._opening import open_run_with
from runlog.schemas._vocabulary import EventType
from tools.benchmarks.common import Scratch, percentile


def _extend(run: Engine, length: int) -> None:
    """Append the synthetic run's mix of events to ``run`` until it has ``length`` events."""
    i = 0
    while run.state.seq < length:
        i += 1
        key = f"x{run.run_id[-8:]}{i:08d}"
        steps: list[tuple[EventType, dict[str, Any]]] = [
            (EventType.USER_MESSAGE, {"content": f"step {i}: please continue " + "x" * 120}),
            (
                EventType.MODEL_TURN,
                {
                    "text": f"calling lookup for step {i} " + "y" * 200,
                    "tool_calls": [
                        {"call_id": f"e{i}", "name": "lookup", "args_json": f'{{"e":{i}}}'}
                    ],
                    "usage": {"input_tokens": 900 + i, "output_tokens": 120},
                    "cost_usd": 0.002,
                },
            ),
        ]
        for et, kw in steps:
            if run.state.seq < length:
                run.emit(et, **kw)
        if run.state.seq < length:
            started = run.emit(
                EventType.TOOL_CALL_STARTED,
                call_id=f"e{i}",
                name="lookup",
                args_json=f'{{"e":{i}}}',
                idempotency_key=key,
            )
            if run.state.seq < length:
                run.emit(
                    EventType.TOOL_CALL_COMPLETED,
                    call_id=f"e{i}",
                    name="lookup",
                    started_seq=started.seq,
                    content=f"result {i} " + "z" * 300,
                    idempotency_key=key,
                    duration_ms=3,
                )
        if i % 50 == 0:
            run.barrier()
    run.barrier()


def _timed_replay(settings: Settings, services: Services, tenant: str, run_id: str) -> float:
    t0 = time.perf_counter()
    got = replay(settings, services.redis, run_id, tenant=tenant)
    elapsed = time.perf_counter() - t0
    assert got.state.seq > 0, run_id
    return elapsed


def measure(
    settings: Settings, *, events: int, repeats: int, length: int, replays: int
) -> dict[str, Any]:
    tenant, parent = write_synthetic_run(settings, events)
    services = Services(settings)
    try:
        deps = dataclasses.replace(services.run_deps(), snapshots=None)
        head = replay(settings, services.redis, parent, tenant=tenant).state.seq

        def one() -> tuple[float, str]:
            t0 = time.perf_counter()
            made = fork_run_with(deps, parent, tenant=tenant, at_seq=head, reason="bench")
            return time.perf_counter() - t0, made.run_id

        first_s, _ = one()
        timed = [one() for _ in range(repeats)]
        lat = [t for t, _ in timed]
        fork_id = timed[-1][1]

        with open_run_with(deps, fork_id, tenant=tenant) as run:
            _extend(run, length)
            fork_len = run.state.seq
        with open_run_with(deps, tenant=tenant, agent="fork-bench", goal="plain") as run:
            _extend(run, length)
            plain_id, plain_len = run.run_id, run.state.seq
        assert fork_len == plain_len == length, (fork_len, plain_len, length)
        fork_t: list[float] = []
        plain_t: list[float] = []
        parent_t: list[float] = []
        for _ in range(replays):
            fork_t.append(_timed_replay(settings, services, tenant, fork_id))
            plain_t.append(_timed_replay(settings, services, tenant, plain_id))
            parent_t.append(_timed_replay(settings, services, tenant, parent))
        ratios = [f / p for f, p in zip(fork_t, plain_t, strict=True)]
        return {
            "events": head,
            "repeats": repeats,
            "first_s": first_s,
            "p50_s": statistics.median(lat),
            "p99_s": percentile(lat, 99),
            "max_s": max(lat),
            "latencies_s": lat,
            "length": length,
            "replays": replays,
            "fork_replay_ms": statistics.median(fork_t) * 1000,
            "plain_replay_ms": statistics.median(plain_t) * 1000,
            "parent_replay_ms": statistics.median(parent_t) * 1000,
            "ratio": statistics.median(ratios),
        }
    finally:
        services.close()


def run(
    base: Settings, *, out: Path, events: int, repeats: int, length: int, replays: int
) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    scratch = Scratch.create(base)
    try:
        return measure(
            scratch.settings, events=events, repeats=repeats, length=length, replays=replays
        )
    finally:
        scratch.cleanup()


def report(r: dict[str, Any]) -> str:
    return "\n".join(
        [
            f"fork of a {r['events']}-event run at its last event ({r['repeats']} forks): "
            f"p50 {r['p50_s']:.2f} s, p99 {r['p99_s']:.2f} s, max {r['max_s']:.2f} s "
            f"(target p50 <= 1 s at 10,000 events); a process's first {r['first_s']:.2f} s",
            f"replay ({r['replays']} each, median): that fork continued to {r['length']} events "
            f"{r['fork_replay_ms']:.0f} ms, a plain run of {r['length']} events "
            f"{r['plain_replay_ms']:.0f} ms: fork / plain {r['ratio']:.2f} (target <= 1); "
            f"the parent's own {r['events']} events {r['parent_replay_ms']:.0f} ms",
        ]
    )
