"""``runlog cancel`` / ``runlog terminate``: a person stops a run, with who and why recorded
in its log. ``runlog reconcile``: a person has the fleet settle a run's uncertain calls with
their tools' lookups."""

from __future__ import annotations

import argparse
import getpass
import sys

from runlog._api import RECONCILE_WAIT_S, cancel, reconcile, terminate
from runlog.cli._groups import EXIT_FAILURE, print_json
from runlog.errors import RunFinished


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "cancel",
        help="ask a run to stop (cooperative): its agent sees runlog.Cancelled, the run ends "
        "cancelled",
        description=(
            "Records the request in the run's log (who, when, why). The run's owner sees it "
            "at its first step (a model turn or tool call) that begins 50 ms or more after "
            "the request (its next step, unless its steps come faster) and "
            "raises runlog.Cancelled into the agent, which may clean up; the run then ends "
            "`cancelled`. A run no one holds is shown as cancelling and is cancelled when "
            "next opened; a run of the fleet that waits or that no one holds is dispatched "
            "at once. Open calls are not closed: the recovery rules still settle them. "
            "Exits 1 if the run has already ended."
        ),
    )
    _common(p)
    p.add_argument(
        "--wait", type=float, default=5.0, help="seconds to watch for the owner to record it"
    )
    p.set_defaults(func=_cancel)

    p = sub.add_parser(
        "terminate",
        help="end a run now, without its owner: the owner is fenced, the run ends terminated",
        description=(
            "Takes the run with a higher epoch (the owner's lease is broken: its next append "
            "is refused and it invokes no further tool) and records the run ended "
            "`terminated` with who and why. Nothing is recovered: its open calls are listed "
            "for reconciliation (here, in `runlog show` and in the console). Exits 1 if the "
            "run has already ended."
        ),
    )
    _common(p)
    p.set_defaults(func=_terminate)

    p = sub.add_parser(
        "reconcile",
        help="settle a run's uncertain calls with their tools' lookups, on a worker of the fleet",
        description=(
            "Asks the fleet (a durable request, like a start) to run the declared lookup "
            "(reconcile=) of KEY, or of every uncertain call of the run a lookup can settle, "
            "on a worker that serves the run's agent, and records the outcome as recovery "
            "does: a match completes the call (source=reconciliation), a conflict is "
            "escalated to a person, no evidence leaves it uncertain. A terminated run is "
            "settled without being resumed; a run held by a live owner is waited for. "
            "Prints what the run's log then says of each key. Exits 1 when nothing was "
            "checked: no live worker serves the agent (unless --queue), no answer within "
            "--wait (the request stays queued), or a key that is not uncertain, waits for a "
            "person, or has no lookup; 4 for an unknown run."
        ),
    )
    p.add_argument("run_id")
    p.add_argument("key", nargs="?", default=None, help="the call's idempotency key (default: all)")
    p.add_argument("--tenant", default="default")
    p.add_argument("--by", default=None, help="who asks (default: the OS user)")
    p.add_argument(
        "--wait",
        type=float,
        default=RECONCILE_WAIT_S,
        help=f"seconds to wait for a worker's answer (default {RECONCILE_WAIT_S:g})",
    )
    p.add_argument(
        "--queue",
        action="store_true",
        help="record the request even when no live worker serves the agent now",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_reconcile)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_id")
    p.add_argument("--tenant", default="default")
    p.add_argument("--reason", required=True, help="why (required; recorded in the log)")
    p.add_argument("--by", default=None, help="who asks (default: the OS user)")
    p.add_argument("--json", action="store_true")


def _cancel(args: argparse.Namespace) -> int:
    by = args.by or getpass.getuser()
    try:
        how = cancel(args.run_id, reason=args.reason, by=by, tenant=args.tenant, wait_s=args.wait)
    except RunFinished as exc:
        print(f"runlog: nothing to cancel: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except ValueError as exc:
        print(f"runlog: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    if args.json:
        print_json({"run_id": args.run_id, "tenant": args.tenant, "cancel": how, "by": by})
    elif how == "queued":
        print(f"cancel of {args.run_id}: queued for its owner (it sees it at its next step)")
    elif how == "already":
        print(f"cancel of {args.run_id}: an earlier cancellation stands (`runlog show`)")
    else:
        print(f"cancel of {args.run_id}: recorded in its log by {by}")
    return 0


def _terminate(args: argparse.Namespace) -> int:
    by = args.by or getpass.getuser()
    try:
        done = terminate(args.run_id, reason=args.reason, by=by, tenant=args.tenant)
    except RunFinished as exc:
        print(f"runlog: nothing to terminate: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except ValueError as exc:
        print(f"runlog: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    calls = [
        {
            "idempotency_key": c.idempotency_key,
            "tool": c.name,
            "risk": c.risk,
            "status": c.status,
            "started_at": c.started_at.isoformat(),
        }
        for c in done.open_calls
    ]
    if args.json:
        print_json(
            {
                "run_id": done.run_id,
                "tenant": args.tenant,
                "status": "terminated",
                "epoch": done.epoch,
                "seq": done.seq,
                "by": by,
                "open_calls": calls,
            }
        )
        return 0
    print(f"terminated {done.run_id} at epoch {done.epoch} (seq {done.seq}) by {by}")
    if calls:
        print(f"{len(calls)} open call(s) left for reconciliation:")
        for c in calls:
            print(
                f"  {c['tool']:<14} key={c['idempotency_key']} risk={c['risk']} "
                f"{c['status']} since {c['started_at']}"
            )
    return 0


def _reconcile(args: argparse.Namespace) -> int:
    by = args.by or getpass.getuser()
    done = reconcile(
        args.run_id, args.key, by=by, tenant=args.tenant, wait_s=args.wait, queue=args.queue
    )
    rows = [
        {"idempotency_key": x.key, "tool": x.name, "outcome": x.outcome, "evidence": x.evidence}
        for x in done.settled
    ]
    if args.json:
        print_json(
            {
                "run_id": done.run_id,
                "tenant": args.tenant,
                "epoch": done.epoch,
                "run_ended": done.finished,
                "by": by,
                "calls": rows,
            }
        )
        return 0
    ended = " (an ended run: settled, not resumed)" if done.finished else ""
    print(f"reconciled {done.run_id} at epoch {done.epoch} by {by}{ended}")
    for r in rows:
        how = "completed (reconciliation)" if r["outcome"] == "completed" else r["outcome"]
        print(f"  {r['tool']:<14} key={r['idempotency_key']} {how}: {r['evidence']}")
    return 0
