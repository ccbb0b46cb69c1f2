"""``runlog bench [--quick] [--out DIR]``: the benchmarks of ``tools.benchmarks.run``.

A clone-only command: the benchmarks live in ``tools/benchmarks`` of a clone, outside the
installed package, and are loaded when the command runs (``runlog.cli._tooling``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from runlog._settings import Settings
from runlog.cli import _tooling as tooling


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "bench",
        help="measure runlog against a raw producer, fsync'd file and SQLite (scratch topics)",
        description=(
            "Durable append latency, throughput with many runs, replay, recovery, projection "
            "lag and memory, on scratch topics (deleted afterwards) of the stack RUNLOG_* "
            "names. Prints a table (min / median / max over repeats) and writes results.json, "
            "results.txt and PNG plots (needs the 'bench' extra: matplotlib). Clone-only: "
            "the benchmarks live in tools/benchmarks of a clone of runlog, not in the "
            "installed package."
        ),
    )
    p.add_argument(
        "what",
        nargs="?",
        choices=["lag", "pydantic-ai", "steps", "integrity", "fleet", "fork", "handover", "scale"],
        help=(
            "lag: only projection lag under a steady load, and drain rate by run length; "
            "integrity: only the CPU cost per record of tenant MACs and decider signatures "
            "(no stack needed); "
            "pydantic-ai: only section 9, a Pydantic AI agent step bare and as a runlog run; "
            "steps: only section 8, a durable step side by side (runlog, LangGraph on "
            "SqliteSaver, runlog's checkpointer and PostgresSaver, DBOS, Restate's server and "
            "Python SDK, the OpenAI Agents SDK and Pydantic AI alone and on runlog); "
            "fleet: `runlog worker` processes: dispatch latency, failover of a SIGKILLed "
            "worker's open runs, durable steps per second; "
            "handover: a SIGTERMed worker's runs (mid-step, mid-sleep; SIGKILL 2 s later or "
            "never) to their next event on another worker, a SIGKILLed worker's failover at "
            "--held and --many open runs, the liveness traffic in Redis, effects doubled/lost; "
            "fork: forking a long run at its last event (p50, p99) and replaying a fork "
            "against a plain run of the same length; "
            "scale: long runs (bytes per token, append cost at the start and end of a "
            "--long-events run, resume with and without snapshots) and many runs (opens at "
            "once, --waiting runs on durable timers due in one second, --waiting-many runs "
            "waiting (half on timers a day ahead, half on people), a --million-events run, "
            "a worker beside --lifecycle-records, "
            "--stepping runs open in one worker), beside references"
        ),
    )
    p.add_argument("--quick", action="store_true", help="small sizes, one repeat (CI smoke)")
    p.add_argument("--out", type=Path, default=Path("bench-results"), help="output directory")
    p.add_argument("--rate", type=float, default=5000, help="lag: events/s appended")
    p.add_argument("--runs", type=int, default=100, help="lag: live runs sharing the load")
    p.add_argument("--events-per-run", type=int, default=2000, help="lag: events each run reaches")
    p.add_argument(
        "--drain-total", type=int, default=20_000, help="lag: backlog per drain measurement"
    )
    p.add_argument("--held", type=int, default=200, help="fleet: open runs of the killed worker")
    p.add_argument(
        "--many", type=int, default=2000, help="handover: open runs of the larger failover"
    )
    p.add_argument("--starts", type=int, default=50, help="fleet: starts timed on an idle fleet")
    p.add_argument("--fork-events", type=int, default=10_000, help="fork: events of the run forked")
    p.add_argument("--fork-repeats", type=int, default=9, help="fork: forks timed")
    p.add_argument(
        "--fork-length", type=int, default=2_000, help="fork: events of the fork replayed"
    )
    p.add_argument("--long-events", type=int, default=100_000, help="scale: events of the long run")
    p.add_argument(
        "--waiting", type=int, default=10_000, help="scale: runs waiting on timers at once"
    )
    p.add_argument(
        "--waiting-many",
        type=int,
        default=100_000,
        help="scale: runs waiting, half on timers a day ahead and half on people (what "
        "waiting costs; never fired nor answered)",
    )
    p.add_argument(
        "--million-events", type=int, default=1_000_000, help="scale: events of the longest run"
    )
    p.add_argument(
        "--lifecycle-records",
        type=int,
        default=1_000_000,
        help="scale: lifecycle records a worker starts beside",
    )
    p.add_argument(
        "--stepping", type=int, default=10_000, help="scale: runs open at once in one worker"
    )
    p.add_argument(
        "--parts",
        default="",
        help="scale: comma-separated parts to run (long,opens,timers,waiting,million,"
        "lifecycle,stepping); default all",
    )
    p.set_defaults(func=_bench)


def _bench(args: argparse.Namespace) -> int:
    def bench(name: str) -> Any:
        return tooling.load(f"tools.benchmarks.{name}", "bench")

    if args.what == "scale":
        scale = bench("scale")
        res = scale.run(
            Settings(),
            out=args.out,
            quick=args.quick,
            events=10_000 if args.quick else args.long_events,
            waiting=300 if args.quick else args.waiting,
            waiting_many=None if args.quick else args.waiting_many,
            million=None if args.quick else args.million_events,
            lifecycle_records=None if args.quick else args.lifecycle_records,
            stepping=None if args.quick else args.stepping,
            parts=frozenset(p for p in args.parts.split(",") if p) or None,
        )
        print(scale.report(res))
        return 0
    if args.what == "fork":
        fork = bench("fork")
        quick = args.quick
        res = fork.run(
            Settings(),
            out=args.out,
            events=1_000 if quick else args.fork_events,
            repeats=3 if quick else args.fork_repeats,
            length=200 if quick else args.fork_length,
            replays=3 if quick else 7,
        )
        print(fork.report(res))
        return 0
    if args.what == "handover":
        handover = bench("handover")
        res = handover.run(
            Settings(),
            out=args.out,
            held=20 if args.quick else args.held,
            many=50 if args.quick else args.many,
        )
        print(handover.report(res))
        return 0
    if args.what == "fleet":
        fleet = bench("fleet")
        quick = args.quick
        res = fleet.run(
            Settings(),
            out=args.out,
            starts=10 if quick else args.starts,
            held=20 if quick else args.held,
            runs=10 if quick else 100,
            per_run=5 if quick else 20,
            rounds=1 if quick else 5,
        )
        print(fleet.report(res))
        return 0
    if args.what == "integrity":
        integrity = bench("integrity")
        print(integrity.report(integrity.measure(200 if args.quick else 2000)))
        return 0
    if args.what == "lag":
        res = bench("steady_lag").run(
            Settings(),
            rate=args.rate,
            runs=args.runs,
            events_per_run=args.events_per_run,
            drain_total=args.drain_total,
            out=args.out,
        )
        st = res["steady"]
        print(f"load {st['events']} events at {st['sent_per_s']:.0f} events/s")
        if not st["caught_up"]:
            print(f"NOT caught up: {st['unseen']} events never visible (lag counted to then)")
        print(f"lag p50 {st['p50_ms']:.1f} ms")
        print(f"lag p99 {st['p99_ms']:.1f} ms")
        print(f"lag max {st['max_ms']:.1f} ms")
        for m, rate in res["drain"].items():
            print(f"drain {rate:.0f} events/s (runs of {m} events)")
        for f in res.get("plots", []):
            print(f"plot {f}")
        return 0

    only = {"pydantic-ai": ("pydantic_ai",), "steps": ("steps",)}.get(args.what or "")
    res = bench("run").run_all(Settings(), quick=args.quick, out=args.out, only=only)
    return 1 if res["failed"] else 0
