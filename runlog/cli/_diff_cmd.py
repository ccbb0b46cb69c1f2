"""``runlog diff RUN_A RUN_B``: where two runs diverge, and the effects only one made."""

from __future__ import annotations

import argparse
from typing import Any

from runlog._settings import Settings
from runlog.cli._groups import print_json
from runlog.consumers._diff import diff_runs
from runlog.log._clients import redis_client
from runlog.schemas._keys import check_run_id


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "diff",
        help="where two runs diverge (the first differing event) and the effects each made "
        "that the other did not",
        description="Compares the two runs' histories (a fork's includes its parent's up to "
        "the fork point) event by event, ignoring records that only move ownership, and their "
        "completed effects by key. Exit 4 if either run is unknown (or another tenant's).",
    )
    p.add_argument("run_a")
    p.add_argument("run_b")
    p.add_argument("--tenant", default="default")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_diff)


def _line(e: dict[str, Any] | None) -> str:
    if e is None:
        return "(ends here)"
    return f"{e['run_id']} #{e['seq']} {e['type']}: {e['text']}"


def _diff(args: argparse.Namespace) -> int:
    settings = Settings()
    client = redis_client(settings)
    try:
        d = diff_runs(
            settings, client, args.tenant, check_run_id(args.run_a), check_run_id(args.run_b)
        )
    finally:
        client.close()
    if args.json:
        print_json(d.to_dict())
        return 0
    print(f"{d.common} event(s) in common; then")
    print(f"  {d.a}: {_line(d.first_a)}")
    print(f"  {d.b}: {_line(d.first_b)}")
    for name, only in ((d.a, d.only_a), (d.b, d.only_b)):
        print(f"effects only {name} made:" + ("" if only else " none"))
        for e in only:
            where = f"{e.get('run_id', '?')} #{e.get('seq', '?')}"
            print(f"  {e.get('tool') or '?'} {e.get('args_json') or ''} key={e['key']} ({where})")
    return 0
