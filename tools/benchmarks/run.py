"""Run every benchmark in one process and one sitting, so their ratios are comparable.

    python -m tools.benchmarks.run [--quick] [--out DIR]      (or: runlog bench, make bench)

Everything runs on scratch topics and Redis keys under a unique prefix (deleted
afterwards) against the stack the settings name. Writes ``results.json``, ``results.txt``
and PNG plots to the output directory and returns the results.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

from runlog._bootstrap import Services
from runlog._settings import Settings
from tools.benchmarks import (
    encoding,
    lag,
    latency,
    memory,
    pydantic_ai_steps,
    recovery,
    replay,
    report,
    throughput,
)
from tools.benchmarks import steps as durable_steps
from tools.benchmarks.common import Scratch, machine, settings_summary

log = logging.getLogger("runlog.bench")

SECTIONS = (
    "latency",
    "throughput",
    "replay",
    "recovery",
    "projection_lag",
    "memory",
    "encoding",
    "steps",
    "pydantic_ai",
)


@dataclass(frozen=True)
class Plan:
    """How much of each benchmark to run."""

    repeats: int
    latency_appends: int
    throughput_runs: tuple[int, ...]
    throughput_events: int
    barrier_every: int
    replay_lengths: tuple[int, ...]
    replay_kafka_lengths: tuple[int, ...]
    interleave_len: int
    interleave_others: tuple[int, ...]
    recovery_ttl_ms: int
    resume_events: int
    lag_rate: float
    lag_seconds: float
    lag_runs: int
    memory_runs: int
    memory_events: int
    memory_open_threads: int
    step_count: int
    agent_steps: int
    fanout_runs: int
    fanout_calls: int


FULL = Plan(
    repeats=3,
    latency_appends=500,
    throughput_runs=(1, 10, 100),
    throughput_events=20_000,
    barrier_every=10,
    replay_lengths=(100, 1_000, 10_000, 100_000),
    replay_kafka_lengths=(101, 1_001, 10_001, 100_001),
    interleave_len=1_001,
    interleave_others=(1, 100),
    recovery_ttl_ms=2_000,
    resume_events=4_000,
    lag_rate=200.0,
    lag_seconds=10.0,
    lag_runs=10,
    memory_runs=100,
    memory_events=10,
    memory_open_threads=10,
    step_count=1_000,
    agent_steps=30,
    fanout_runs=100,
    fanout_calls=20,
)

QUICK = Plan(
    repeats=1,
    latency_appends=100,
    throughput_runs=(1, 10, 100),
    throughput_events=2_000,
    barrier_every=10,
    replay_lengths=(100, 500, 2_000),
    replay_kafka_lengths=(101, 501, 2_001),
    interleave_len=201,
    interleave_others=(20,),
    recovery_ttl_ms=1_000,
    resume_events=4_000,
    lag_rate=100.0,
    lag_seconds=2.0,
    lag_runs=4,
    memory_runs=100,
    memory_events=2,
    memory_open_threads=50,
    step_count=100,
    agent_steps=10,
    fanout_runs=20,
    fanout_calls=5,
)


def run_all(
    base: Settings,
    *,
    quick: bool = False,
    out: Path | None = None,
    echo: Callable[[str], None] = print,
    only: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Run the benchmarks against the stack ``base`` points at; write results to ``out``.

    ``only`` names the sections to run (default: every one of ``SECTIONS``)."""

    plan = QUICK if quick else FULL
    started = time.perf_counter()
    settings_note = Scratch.create(base)  # the settings every section's scratch copies
    s0 = settings_note.settings
    settings_note.cleanup()
    res: dict[str, Any] = {
        "mode": "quick" if quick else "full",
        "repeats": plan.repeats,
        "plan": asdict(plan),
        "machine": machine(s0),
        "settings": settings_summary(s0),
        "failed": [],
    }
    echo(report.machine_lines({**res, "elapsed_s": 0.0})[1])
    # Each section runs as step(deps, settings) on its own scratch topics.
    Step = Callable[[Any, Settings], dict[str, Any]]
    r = plan.repeats
    steps: list[tuple[str, Step]] = [
        ("latency", partial(latency.measure, n=plan.latency_appends, repeats=r)),
        (
            "throughput",
            partial(
                throughput.measure,
                run_counts=plan.throughput_runs,
                total_events=plan.throughput_events,
                batch=plan.barrier_every,
                repeats=r,
            ),
        ),
        (
            "replay",
            lambda deps, s: replay.measure(
                s,
                lengths=plan.replay_lengths,
                kafka_lengths=plan.replay_kafka_lengths,
                interleave_len=plan.interleave_len,
                others=plan.interleave_others,
                repeats=r,
                deps=deps,
            ),
        ),
        (  # on topics of its own, with a short lease TTL
            "recovery",
            lambda deps, s: recovery.measure(
                deps, base, ttl_ms=plan.recovery_ttl_ms, resume_events=plan.resume_events, repeats=r
            ),
        ),
        (
            "projection_lag",
            partial(
                lag.measure,
                rate=plan.lag_rate,
                seconds=plan.lag_seconds,
                runs=plan.lag_runs,
                repeats=r,
            ),
        ),
        ("encoding", partial(encoding.measure, n=plan.latency_appends, repeats=r)),
        (
            "steps",
            partial(
                durable_steps.measure,
                n=plan.step_count,
                repeats=r,
                fanout_runs=plan.fanout_runs,
                fanout_calls=plan.fanout_calls,
            ),
        ),
        ("pydantic_ai", partial(pydantic_ai_steps.measure, n=plan.agent_steps, repeats=r)),
        (
            "memory",
            lambda deps, s: memory.measure(
                s,
                runs=plan.memory_runs,
                events=plan.memory_events,
                threads=plan.memory_open_threads,
                repeats=r,
            ),
        ),
    ]
    timings: dict[str, float] = {}
    res["section_seconds"] = timings
    if only is not None:
        unknown = set(only) - set(SECTIONS)
        if unknown:
            raise ValueError(f"no bench sections {sorted(unknown)}; they are {SECTIONS}")
        steps = [(name, step) for name, step in steps if name in only]
    for name, step in steps:
        # Each section gets fresh topics: one section's records must not slow another's
        # reads (a new run's open scans the last minute of its partition, for instance).
        t0 = time.perf_counter()
        echo(f"bench: {name} ...")
        scratch = Scratch.create(base)
        services = Services(scratch.settings)
        try:
            res[name] = step(services.run_deps(), scratch.settings)
        except Exception as exc:
            log.exception("bench section %s failed", name)
            res[name] = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
            res["failed"].append(name)
        finally:
            services.close()
            scratch.cleanup()
        timings[name] = time.perf_counter() - t0
        echo(f"bench: {name} done in {timings[name]:.1f} s")
        if out is not None:  # partial results survive a later failure
            out.mkdir(parents=True, exist_ok=True)
            (out / "results.json").write_text(json.dumps(res, indent=2, sort_keys=True) + "\n")
    res["elapsed_s"] = time.perf_counter() - started
    try:
        import os

        res["machine"]["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    text = report.table(res)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        try:
            res["plots"] = report.plots(res, out)
        except ImportError:
            res["plots"] = []
            echo("bench: matplotlib not installed (pip install -e '.[bench]'): no plots")
        (out / "results.json").write_text(json.dumps(res, indent=2, sort_keys=True) + "\n")
        (out / "results.txt").write_text(text + "\n")
    echo(text)
    return res


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.benchmarks.run", description=__doc__)
    p.add_argument("--quick", action="store_true", help="small sizes, 1 repeat (CI smoke)")
    p.add_argument("--out", type=Path, default=Path("bench-results"))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    res = run_all(Settings(), quick=args.quick, out=args.out)
    return 1 if res["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
