"""``runlog demo``: the supervised reconciliation demo (the same as ``python -m runlog.demo``)."""

from __future__ import annotations

import argparse

from runlog.demo import fleet, supervisor


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:

    p = sub.add_parser(
        "demo",
        help="run the reference reconciliation agent through kill -9, a pause and people",
        description=(
            "Starts the demo's ledger service and the agent as a worker subprocess, kills it "
            "with SIGKILL at seeded random moments and restarts it with the same run id, "
            "pauses one worker past its lease so a second takes over (the first must end "
            "Fenced), decides escalations as the person, then prints a summary read from "
            "the log and the ledger. Exits 1 unless every effect happened exactly once and "
            "the run verifies. The processes alone: python -m runlog.demo ledger|worker."
        ),
    )
    supervisor.add_arguments(p)
    p.set_defaults(func=supervisor.run)
    p = sub.add_parser(
        "demo-fleet",
        help="three `runlog worker` processes killed at random; the runs finish by themselves",
        description=(
            "Requests runs of a refund agent (irreversible calls against a non-idempotent "
            "ledger with a lookup, and a durable timer), starts three workers and SIGKILLs one "
            "at random every few seconds, starting a new one each time. No supervisor resumes "
            "anything: the workers own the partitions. Exits 1 unless every run finished, each "
            "effect once, and every run verifies."
        ),
    )
    fleet.add_arguments(p)
    p.set_defaults(func=fleet.run)
