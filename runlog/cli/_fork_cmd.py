"""``runlog fork``: a new run from a parent's prefix, without repeating its effects."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from runlog._api import fork
from runlog.cli._groups import EXIT_USAGE, print_json
from runlog.producers._forks import EFFECTS_MODES


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "fork",
        help="fork a run after one of its seqs into a new run (its effects are not repeated)",
        description="A new run that begins with a lineage record (parent, seq, digest of the "
        "parent's state there, who and why) and the parent's state at --at-seq; it replays "
        "from its own log. Open it like any run to go on. --effects says what a call the "
        "fork makes does when the parent already completed the same logical action after "
        "--at-seq: inherit (default) returns the parent's result, ask stops for a person, "
        "execute repeats it under a key bound to the fork. Exit 4 for an unknown run (or "
        "another tenant's), 1 for a seq outside the run or a run id already used.",
    )
    p.add_argument("run_id", help="the parent run")
    p.add_argument("--tenant", default="default")
    p.add_argument("--at-seq", type=int, required=True, help="fork after this valid seq")
    p.add_argument("--run-id", dest="new_run_id", default=None, help="the fork's id (retryable)")
    p.add_argument("--input", default=None, help="JSON for the fork's agent (recorded)")
    p.add_argument("--effects", choices=EFFECTS_MODES, default="inherit")
    p.add_argument("--reason", default="", help="why (recorded in the lineage)")
    p.add_argument("--by", default="", help="who forks (recorded; default: this worker)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_fork)


def _fork(args: argparse.Namespace) -> int:
    if args.input is not None:
        try:
            json.loads(args.input)
        except ValueError as exc:
            print(f"runlog: --input is not JSON: {exc}", file=sys.stderr)
            return EXIT_USAGE
    made = fork(
        args.run_id,
        tenant=args.tenant,
        at_seq=args.at_seq,
        new_run_id=args.new_run_id,
        input=args.input,
        effects=args.effects,
        forked_by=args.by,
        reason=args.reason,
    )
    if args.json:
        print_json(made.to_dict())
        return 0
    verb = "forked" if made.created else "already forked"
    print(
        f"{verb}: {made.run_id} from {made.parent_run_id} at seq {made.at_seq} "
        f"(effects {made.effects}, parent state digest {made.parent_digest[:16]})"
    )
    lines: list[Any] = made.other_timeline
    for e in lines:
        print(f"  other timeline: {e.name} {e.args_json} in {e.run_id} #{e.seq} {e.status}")
    return 0
