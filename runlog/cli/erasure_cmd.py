"""``runlog forget``: erase a data subject's (or one run's) content; ``runlog retention``:
per-tenant retention policies and the job that applies them."""

from __future__ import annotations

import argparse
import dataclasses
import getpass
import sys

from runlog.api import forget
from runlog.cli.groups import EXIT_FAILURE, print_json
from runlog.errors import RunlogError


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "forget",
        help="erase a data subject's content (or one run's): crypto-shred and purge",
        description=(
            "Erases the content of every run of a data subject in a tenant (--subject; a "
            "run's subject is the one its start named, else the run itself), or of one run "
            "(--run). A run in progress is terminated first (its owner is fenced). Each run's "
            "log records content_erased (who, when, why); the subject's keys are destroyed; "
            "the run's snapshots are deleted; the projection services purge their copies when "
            "they fold the record; Redis's AOF and RDB are rewritten. Structure (ids, seq, "
            "outcome, who did what) stays; contents read as erased. Idempotent: run it again "
            "after a crash and it completes what is left."
        ),
    )
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--subject", help="the data subject (a person or account id)")
    which.add_argument("--run", dest="run_id", help="one run")
    p.add_argument("--tenant", required=True)
    p.add_argument("--reason", required=True, help="why (required; recorded in each run's log)")
    p.add_argument("--by", default=None, help="who erases (default: the OS user)")
    p.add_argument(
        "--wait", type=float, default=60.0, help="seconds to wait for the projections' purge"
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_forget)


def _forget(args: argparse.Namespace) -> int:
    by = args.by or getpass.getuser()
    try:
        report = forget(
            tenant=args.tenant,
            subject=args.subject,
            run_id=args.run_id,
            reason=args.reason,
            by=by,
            wait_s=args.wait,
        )
    except (RunlogError, ValueError) as exc:
        print(f"runlog: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    if args.json:
        print_json(dataclasses.asdict(report))
    else:
        for r in report.runs:
            how = "already erased" if r.already else "erased"
            if r.terminated:
                how = "terminated, then erased"
            print(f"{r.run_id}: {how} (subject {r.subject}, seq {r.seq})")
        if not report.runs:
            print(f"no run of {args.subject or args.run_id} in tenant {args.tenant}")
        print(
            f"keys shredded: {len(report.keys_shredded)}; snapshots deleted: "
            f"{report.snapshots_deleted}; projections purged: {report.projections_purged}; "
            f"redis files rewritten: {report.persistence_rewritten}"
        )
    ok = report.projections_purged is not False and report.persistence_rewritten is not False
    return 0 if ok else EXIT_FAILURE
