"""``runlog demo``: the fleet demo (the same as ``python -m runlog.demo``)."""

from __future__ import annotations

import argparse

from runlog.demo import run


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
            "each effect once, and every run verifies."
        ),
    )
    run.add_arguments(p)
    p.set_defaults(func=run.run)
