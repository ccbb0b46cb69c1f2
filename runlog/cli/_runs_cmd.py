"""``runlog explain`` / ``runlog approve`` / ``runlog reject``: the question a run's approval
request puts to a person, and the person's decision; ``runlog approvals``: the requests
waiting for one."""

from __future__ import annotations

import argparse
import getpass
import sys
from collections.abc import Callable
from typing import Any

from runlog._api import decide, question
from runlog._settings import Settings
from runlog.cli._groups import print_json
from runlog.consumers._index import age_text
from runlog.consumers._queries import approvals_report
from runlog.errors import DecisionConflict, NotADecider, NotUndoable
from runlog.log._clients import redis_client


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
            "when the tool declared an inverse), and, where the tool declared an inverse, "
            "undo and retry (`runlog approve RUN AP --undo-and-retry`) runs the inverse and "
            "then the call again under a fresh key. Read from the log."
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
        if approved:
            p.add_argument(
                "--undo-and-retry",
                action="store_true",
                help="for a call whose tool declared an inverse (compensate=): run the "
                "inverse of what may have happened, and only once it completed the call "
                "again under a fresh key (refused, exit 1, where the tool has no inverse)",
            )
        p.set_defaults(func=_handler(approved))

    p = sub.add_parser(
        "approvals",
        help="approval requests waiting for a person, with deadlines and notifications",
        description="Read from the notify projection (`runlog project notify`): who asked, "
        "when and why, by when the decision is due, and the delivery of the request's "
        "notification. --overdue: only the requests whose deadline has passed.",
    )
    p.add_argument("--tenant", default=None, help="only this tenant's requests")
    p.add_argument("--overdue", action="store_true", help="only those past their deadline")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_approvals)


def _approvals(args: argparse.Namespace) -> int:
    settings = Settings()
    client = redis_client(settings)
    try:
        rep = approvals_report(client, settings, tenant=args.tenant)
    finally:
        client.close()
    rows = rep.overdue if args.overdue else rep.pending
    if not rep.tracked:
        print(
            "runlog: the notify projection has folded nothing yet (`runlog project notify`)",
            file=sys.stderr,
        )
    if args.json:
        print_json({**rep.to_dict(), "pending": rows})
        return 0
    for a in rows:
        print(_line(a))
    what = "overdue" if args.overdue else "pending"
    print(f"{len(rows)} {what} approval request(s)", file=sys.stderr)
    return 0


def _line(a: dict[str, Any]) -> str:
    n = a["notification"]
    if a["due_at"] is None:
        due = "no deadline"
    elif a["overdue"]:
        due = f"OVERDUE by {age_text(a['overdue_s'])} (due {a['due_at']})"
    else:
        due = f"due in {age_text(-a['overdue_s'])} ({a['due_at']})"
    tool = f" {a['tool']} key={a['idempotency_key']}" if a.get("tool") else ""
    sent = f"notification {n['status']} ({n['attempts']} attempt(s))"
    if n["delivered_at"]:
        sent += f" at {n['delivered_at']}"
    elif n["last_error"]:
        sent += f": {n['last_error']}"
    return (
        f"{a['tenant']}/{a['run_id']} {a['approval_id']} {a['kind']}{tool}: {a['reason']}\n"
        f"    asked {a['requested_at']} by {a['requested_by']} (waiting "
        f"{age_text(a['waiting_s'])}); {due}; {sent}"
    )


def _handler(approved: bool) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        undo = bool(getattr(args, "undo_and_retry", False))
        try:
            how = decide(
                args.run_id,
                args.approval_id,
                approved=approved,
                decided_by=args.by or getpass.getuser(),
                note=args.note,
                tenant=args.tenant,
                undo_and_retry=undo,
            )
        except (DecisionConflict, NotADecider, NotUndoable) as exc:
            # A person's decision is final, only a decider's signed one counts, and "undo"
            # needs an inverse.
            print(f"runlog: refused: {exc}; this decision was not recorded", file=sys.stderr)
            return 1
        verb = "approved" if approved else "rejected"
        if undo:
            verb = "undo and retry of"
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
            if q.undoable:
                print(f"    or: runlog approve {where} --undo-and-retry --note WHY")
    return 0
