"""``runlog records set-aside|list``: the operator's decision on a record nobody can read."""

from __future__ import annotations

import argparse
from typing import Any

from runlog._settings import Settings
from runlog.cli._groups import command_group, print_json
from runlog.errors import ConfigError, SchemaError
from runlog.log._clients import redis_client
from runlog.log._keys import keys_for
from runlog.log._reader import LogReader
from runlog.log._registry import ids_for
from runlog.log._setaside import list_set_aside, set_aside
from runlog.schemas._codec import decode


def register(subparsers: Any) -> None:
    sub = command_group(
        subparsers, "records", help="set aside an events-topic record that cannot be decoded"
    )
    p_set = sub.add_parser(
        "set-aside",
        help="every reader of runs skips this record from now on (only an unreadable one)",
    )
    p_set.add_argument("--partition", type=int, required=True)
    p_set.add_argument("--offset", type=int, required=True)
    p_set.add_argument("--by", required=True, help="who decided (kept with the decision)")
    p_set.add_argument("--reason", required=True, help="why the run does not need it")
    p_set.set_defaults(func=_set_aside)
    p_list = sub.add_parser("list", help="records set aside, with who, when and why")
    p_list.add_argument("--json", action="store_true")
    p_list.set_defaults(func=_list)


def _set_aside(args: argparse.Namespace) -> int:
    settings = Settings()
    with LogReader(settings) as reader:
        key, value = reader.record_at(args.partition, args.offset)
    try:
        decode(value or b"", ids_for(settings), keys_for(settings))
    except SchemaError as exc:
        error = f"{type(exc).__name__}: {exc}"
    else:
        raise ConfigError(
            f"{settings.events_topic}[{args.partition}]@{args.offset} decodes: only a record "
            "that cannot be read may be set aside"
        )
    client = redis_client(settings)
    try:
        new = set_aside(
            client,
            settings,
            args.partition,
            args.offset,
            by=args.by,
            reason=args.reason,
            error=error,
        )
    finally:
        client.close()
    run = (key or b"").decode(errors="replace")
    state = "set aside" if new else "was already set aside"
    print(f"{settings.events_topic}[{args.partition}]@{args.offset} (key {run!r}) {state}")
    return 0


def _list(args: argparse.Namespace) -> int:
    settings = Settings()
    client = redis_client(settings)
    try:
        entries = list_set_aside(client, settings)
    finally:
        client.close()
    if args.json:
        print_json(entries)
        return 0
    for e in entries:
        print(f"[{e['partition']}]@{e['offset']}  by {e['by']} at {e['at']}: {e['reason']}")
        print(f"    {e['error']}")
    if not entries:
        print("no records set aside")
    return 0
