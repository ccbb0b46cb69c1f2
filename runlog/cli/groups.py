"""Commands whose subcommands are their actions (``runlog topics create``, ...), and the
one way every command prints ``--json``."""

from __future__ import annotations

import argparse
import json
from typing import Any


def command_group(subparsers: Any, name: str, help: str, **kw: Any) -> Any:
    """Register ``runlog NAME ACTION``; returns the subparsers its actions are added to."""
    parser: argparse.ArgumentParser = subparsers.add_parser(name, help=help, **kw)
    return parser.add_subparsers(dest=f"{name}_command", required=True)


def print_json(value: Any) -> None:
    """``--json`` output: indented, keys sorted, anything else (a datetime) as its str."""
    print(json.dumps(value, indent=2, sort_keys=True, default=str))
