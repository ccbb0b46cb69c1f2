"""``runlog explain`` / ``runlog approve`` / ``runlog reject``: the question a run's approval
request puts to a person, and the person's decision."""

from __future__ import annotations

import argparse
import getpass
import sys
from collections.abc import Callable

from runlog.api import decide, question
from runlog.cli.groups import print_json
from runlog.errors import DecisionConflict


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "explain",
        help="what an approval request asks, and what approving or rejecting does",
        description=(
            "Read before `runlog approve`/`reject`. For an uncertain call: the tool, its "
            "canonical arguments (redacted), the idempotency key, when it started and each "
            "attempt with its error, the last error, every reconciliation step with its "
            "evidence, and what each answer does: approve retries with the same key (which "
            "REPEATS an effect that landed unless the tool declared that its receiver "
            "deduplicates by the key), reject closes it without retrying (undoing it first "
            "when the tool declared an inverse). Read from the log."
        ),
    )
    p.add_argument("run_id")
    p.add_argument("approval_id")
    p.add_argument("--tenant", default="default")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_explain)
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
                "exits 1 and names the decision that stands. `runlog explain RUN AP` first "
                "says what may have happened and what each answer does."
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
        except DecisionConflict as exc:
            # A person's decision is final: this one was not recorded.
            print(f"runlog: refused: {exc}; this decision was not recorded", file=sys.stderr)
            return 1
        verb = "approved" if approved else "rejected"
        if how == "queued":
            print(f"{verb} {args.approval_id}: queued for the run's current owner")
        else:
            print(f"{verb} {args.approval_id}: recorded in {args.run_id}'s log")
        return 0

    return run


def _explain(args: argparse.Namespace) -> int:
    q = question(args.run_id, args.approval_id, tenant=args.tenant)
    if args.json:
        print_json(q.to_dict())
    else:
        print("\n".join(q.lines()))
        if q.decided is None:
            where = f"{args.run_id} {args.approval_id} --tenant {args.tenant}"
            print(f"decide: runlog approve {where} --note WHY  |  runlog reject {where} --note WHY")
    return 0
