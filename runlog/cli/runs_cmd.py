"""``runlog approve`` / ``runlog reject``: a person's decision on a run's approval request."""

from __future__ import annotations

import argparse
import getpass
import sys
from collections.abc import Callable

from runlog.api import decide
from runlog.errors import DecisionConflict, NotADecider


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    for name, approved in (("approve", True), ("reject", False)):
        p = sub.add_parser(
            name,
            help=f"{name} a pending approval request of a run",
            description=(
                "For an uncertain call: approve = it did not happen, retry it with the same "
                "idempotency key; reject = it must not run again (the note is recorded as "
                "its result; a reversible call with an inverse is undone first, by the run's "
                "next owner with its tools). For an action approval: approve lets it run, "
                "reject denies it. A decision is final: on an approval already decided this "
                "exits 1 and names the decision that stands."
            ),
        )
        p.add_argument("run_id")
        p.add_argument("approval_id")
        p.add_argument("--tenant", default="default")
        p.add_argument("--by", default=None, help="who decides (default: the OS user)")
        p.add_argument("--note", default="", help="the evidence or reason")
        p.set_defaults(func=_handler(approved))


def _handler(approved: bool) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            how = decide(
                args.run_id,
                args.approval_id,
                approved=approved,
                decided_by=args.by or getpass.getuser(),
                note=args.note,
                tenant=args.tenant,
            )
        except (DecisionConflict, NotADecider) as exc:
            # A person's decision is final, and only a decider's signed one counts.
            print(f"runlog: refused: {exc}; this decision was not recorded", file=sys.stderr)
            return 1
        verb = "approved" if approved else "rejected"
        if how == "queued":
            print(f"{verb} {args.approval_id}: queued for the run's current owner")
        else:
            print(f"{verb} {args.approval_id}: recorded in {args.run_id}'s log")
        return 0

    return run
