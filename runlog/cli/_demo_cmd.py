"""``runlog demo``: the fleet demo (the same as ``python -m tools.demo`` in a clone).

A clone-only command: the demo lives in ``tools/demo`` of a clone, outside the installed
package, and is loaded when the command runs (``runlog.cli._tooling``); its options are
registered all the same, so ``runlog demo --help`` reads alike everywhere.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from runlog.cli import _tooling as tooling


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The demo's options: ``runlog demo`` and ``python -m tools.demo`` alike."""
    p.add_argument("--seed", type=int, default=7, help="the kills' and the orders' seed")
    p.add_argument("--runs", type=int, default=30, help="runs requested")
    p.add_argument("--kills", type=int, default=5, help="workers SIGKILLed, one at a time")
    p.add_argument(
        "--pauses",
        type=int,
        default=2,
        help="workers SIGSTOPped for a few seconds (longer than a lease), then SIGCONTed",
    )
    p.add_argument("--timeout-s", type=float, default=180, help="give up (exit 1) after this")
    p.add_argument("--report", type=Path, help="also write the report as JSON here")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:

    p = sub.add_parser(
        "demo",
        help="three `runlog worker` processes killed at random; the runs finish by themselves",
        description=(
            "Requests runs of a refund agent (irreversible calls against a non-idempotent "
            "ledger with a lookup, and a durable timer), starts three `runlog worker` "
            "processes and SIGKILLs one at random every few seconds, starting a new one each "
            "time. No supervisor resumes anything: the workers own the partitions. Prints a "
            "report read from the log and the ledger; exits 1 unless every run finished, "
            "each effect once, and every run verifies. Clone-only: the demo lives in "
            "tools/demo of a clone of runlog, not in the installed package."
        ),
    )
    add_arguments(p)
    p.set_defaults(func=_demo)


def _demo(args: argparse.Namespace) -> int:
    rc: int = tooling.load("tools.demo.run", "demo").run(args)
    return rc
