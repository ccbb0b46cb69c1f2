"""``runlog bench [--quick] [--out DIR]``: the benchmarks of ``benchmarks.run``.

``benchmarks`` ships in the distribution but is imported only when the command runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from runlog.benchmarks.run import run_all
from runlog.settings import Settings


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "bench",
        help="measure runlog against a raw producer, fsync'd file and SQLite (scratch topics)",
        description=(
            "Durable append latency, throughput with many runs, replay, recovery, projection "
            "lag and memory, on scratch topics (deleted afterwards) of the stack RUNLOG_* "
            "names. Prints a table (min / median / max over repeats) and writes results.json, "
            "results.txt and PNG plots (needs the 'bench' extra: matplotlib)."
        ),
    )
    p.add_argument("--quick", action="store_true", help="small sizes, one repeat (CI smoke)")
    p.add_argument("--out", type=Path, default=Path("bench-results"), help="output directory")
    p.set_defaults(func=_bench)


def _bench(args: argparse.Namespace) -> int:

    res = run_all(Settings(), quick=args.quick, out=args.out)
    return 1 if res["failed"] else 0
