"""``runlog forget``: erase a data subject's (or one run's) content; ``runlog retention``:
per-tenant retention policies and the job that applies them."""

from __future__ import annotations

import argparse
import dataclasses
import getpass
import sys
from typing import Any

from runlog._api import apply_retention, forget
from runlog._settings import Settings
from runlog.cli._groups import EXIT_FAILURE, print_json
from runlog.errors import RunlogError
from runlog.producers._erasure import ForgetReport


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
    which.add_argument(
        "--run",
        dest="run_id",
        help="one run (refused, naming them, when its subject has other runs: see --whole-subject)",
    )
    p.add_argument(
        "--whole-subject",
        action="store_true",
        help="with --run: forget every run of the run's data subject (each is stopped and "
        "records its erasure, as with --subject)",
    )
    p.add_argument("--tenant", required=True)
    p.add_argument("--reason", required=True, help="why (required; recorded in each run's log)")
    p.add_argument("--by", default=None, help="who erases (default: the OS user)")
    p.add_argument(
        "--wait", type=float, default=60.0, help="seconds to wait for the projections' purge"
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_forget)

    r = sub.add_parser(
        "retention",
        help="per-tenant retention: forget the runs that ended longer ago than a policy",
        description=(
            "A tenant's policy (set) says how long its ended runs keep their content; apply "
            "(from cron or a Kubernetes CronJob) forgets every run it covers, as `runlog "
            "forget` does, and reports the runs, subjects and keys. A run of a named data "
            "subject is forgotten only together with all of that subject's runs."
        ),
    )
    rsub = r.add_subparsers(dest="retention_cmd", required=True)
    p = rsub.add_parser("set", help="set (or replace) a tenant's policy")
    p.add_argument("--tenant", required=True)
    p.add_argument(
        "--finished-older-than", required=True, help="an age: 30d, 12h, 90m (whole units)"
    )
    p.add_argument("--by", default=None, help="who sets it (default: the OS user)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_retention_set)
    p = rsub.add_parser("clear", help="remove a tenant's policy")
    p.add_argument("--tenant", required=True)
    p.set_defaults(func=_retention_clear)
    p = rsub.add_parser("show", help="every tenant's policy")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_retention_show)
    p = rsub.add_parser("apply", help="forget what the policies cover (the retention job)")
    p.add_argument("--tenant", default=None, help="only this tenant's policy")
    p.add_argument(
        "--finished-older-than",
        default=None,
        help="this age instead of a stored policy (needs --tenant)",
    )
    p.add_argument("--dry-run", action="store_true", help="report what it would forget")
    p.add_argument("--by", default="retention", help="who the erasures name")
    p.add_argument("--wait", type=float, default=60.0)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_retention_apply)


def _forget(args: argparse.Namespace) -> int:
    by = args.by or getpass.getuser()
    try:
        report = forget(
            tenant=args.tenant,
            subject=args.subject,
            run_id=args.run_id,
            whole_subject=args.whole_subject,
            reason=args.reason,
            by=by,
            wait_s=args.wait,
        )
    except ValueError as exc:
        if isinstance(exc, RunlogError):
            raise  # the CLI's own exit codes: an unknown run is 4, a malformed id 2
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
        for rid in report.requests_dropped:
            print(f"{rid}: start request dropped (no worker had started it)")
        if not report.runs and not report.requests_dropped:
            print(f"no run of {args.subject or args.run_id} in tenant {args.tenant}")
        print(f"looked in {report.checked}")
        print(
            f"keys shredded: {len(report.keys_shredded)}; copies deleted (inboxes, cancel "
            f"flags, snapshots): {report.copies_deleted}; projections purged: "
            f"{report.projections_purged}; redis files rewritten: {report.persistence_rewritten}"
        )
        if report.projections_behind:
            print(
                f"NOT purged yet by {', '.join(report.projections_behind)}: its service is "
                "stopped or behind (it purges when it folds the erasure); start it, then run "
                "this again to see it done"
            )
        _print_plaintext_kept(report)
    return 0 if _purged(report) else EXIT_FAILURE


def _print_plaintext_kept(report: ForgetReport, indent: str = "") -> None:
    """What a forget could not erase: content written in plaintext (encryption off)."""
    if report.log_plaintext_kept:
        runs = ", ".join(report.log_plaintext_runs)
        print(f"{indent}NOT erased from the events topic ({runs}): {report.log_plaintext_note}")


def _purged(report: ForgetReport) -> bool:
    """Whether the forget's purges all ran (None: nothing to purge)."""
    return report.projections_purged is not False and report.persistence_rewritten is not False


def _policy_store() -> tuple[Any, Settings]:
    from runlog.log._clients import redis_client

    settings = Settings()
    return redis_client(settings), settings


def _retention_set(args: argparse.Namespace) -> int:
    from runlog.log import _retention as retention

    client, settings = _policy_store()
    try:
        policy = retention.set_policy(
            client,
            settings,
            args.tenant,
            args.finished_older_than,
            by=args.by or getpass.getuser(),
        )
    except ValueError as exc:
        if isinstance(exc, RunlogError):
            raise  # the CLI's own exit codes: an unknown run is 4, a malformed id 2
        print(f"runlog: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    finally:
        client.close()
    if args.json:
        print_json(dataclasses.asdict(policy))
    else:
        age = policy.finished_older_than
        print(f"retention of {policy.tenant}: forget runs ended more than {age} ago")
    return 0


def _retention_clear(args: argparse.Namespace) -> int:
    from runlog.log import _retention as retention

    client, settings = _policy_store()
    try:
        had = retention.clear_policy(client, settings, args.tenant)
    finally:
        client.close()
    print(f"retention of {args.tenant}: " + ("cleared" if had else "had no policy"))
    return 0


def _retention_show(args: argparse.Namespace) -> int:
    from runlog.log import _retention as retention

    client, settings = _policy_store()
    try:
        found = retention.policies(client, settings)
    finally:
        client.close()
    if args.json:
        print_json([dataclasses.asdict(p) for p in found])
        return 0
    if not found:
        print("no retention policy")
    for p in found:
        print(
            f"{p.tenant}: forget runs ended more than {p.finished_older_than} ago "
            f"(set by {p.set_by} at {p.set_at})"
        )
    return 0


def _retention_apply(args: argparse.Namespace) -> int:
    try:
        jobs = apply_retention(
            tenant=args.tenant,
            finished_older_than=args.finished_older_than,
            dry_run=args.dry_run,
            by=args.by,
            wait_s=args.wait,
        )
    except ValueError as exc:
        if isinstance(exc, RunlogError):
            raise  # the CLI's own exit codes: an unknown run is 4, a malformed id 2
        print(f"runlog: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    if args.json:
        print_json([dataclasses.asdict(j) for j in jobs])
    else:
        if not jobs:
            print("no retention policy applies")
        for j in jobs:
            verb = "would forget" if j.dry_run else "forgot"
            keys = 0 if j.report is None else len(j.report.keys_shredded)
            print(
                f"{j.tenant} (ended before {j.cutoff}): {verb} {len(j.runs)} run(s) of "
                f"{len(j.subjects)} subject(s), {keys} key(s) shredded; kept {len(j.kept)}"
            )
            for rid in j.runs:
                print(f"  {rid}")
            if j.report is not None:
                _print_plaintext_kept(j.report, "  ")
            for rid, why in sorted(j.kept.items()):
                print(f"  kept {rid}: {why}")
    bad = [j for j in jobs if j.report is not None and not _purged(j.report)]
    return EXIT_FAILURE if bad else 0
