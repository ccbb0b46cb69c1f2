"""Commands whose subcommands are their actions (``runlog topics create``, ...)."""

from __future__ import annotations

import argparse
from typing import Any


def command_group(subparsers: Any, name: str, help: str, **kw: Any) -> Any:
    """Register ``runlog NAME ACTION``; returns the subparsers its actions are added to."""
    parser: argparse.ArgumentParser = subparsers.add_parser(name, help=help, **kw)
    return parser.add_subparsers(dest=f"{name}_command", required=True)
