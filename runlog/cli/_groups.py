"""Commands whose subcommands are their actions (``runlog topics create``, ...), and the
one way every command prints ``--json``."""

from __future__ import annotations

import argparse
import json
import signal
from typing import Any


def command_group(subparsers: Any, name: str, help: str, **kw: Any) -> Any:
    """Register ``runlog NAME ACTION``; returns the subparsers its actions are added to."""
    parser: argparse.ArgumentParser = subparsers.add_parser(name, help=help, **kw)
    return parser.add_subparsers(dest=f"{name}_command", required=True)


def print_json(value: Any) -> None:
    """``--json`` output: indented, keys sorted, anything else (a datetime) as its str."""
    print(json.dumps(value, indent=2, sort_keys=True, default=str))


# Exit codes: each means one thing, the same for every command (docs/reference/cli.md).
EXIT_OK = 0
EXIT_FAILURE = 1  # a check failed, a refusal (a decision already made), any other error
EXIT_USAGE = 2  # the command line is wrong: argparse's own, a malformed run id or tenant
EXIT_STACK_DOWN = 3  # `runlog stack status`: the local stack is not running
EXIT_NOT_FOUND = 4  # an unknown run (another tenant's run is answered exactly so), approval
EXIT_INTERRUPTED = 130  # ^C (128 + SIGINT)
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE  # the reader closed the pipe (141)

EXIT_CODES: tuple[tuple[int, str], ...] = (
    (EXIT_OK, "success"),
    (
        EXIT_FAILURE,
        "failure: a check found a problem (`verify`, `topics check`, `schemas check`), a "
        "refusal (a decision on an approval already decided), or any other runlog error "
        "(Kafka or Redis unreachable, a bad setting)",
    ),
    (
        EXIT_USAGE,
        "usage: the command line is wrong (argparse's own errors, a malformed run id or "
        "tenant name, an option value that does not parse)",
    ),
    (EXIT_STACK_DOWN, "`runlog stack status` only: the local stack is not running"),
    (
        EXIT_NOT_FOUND,
        "not found: an unknown run, an approval id the run never issued, or another "
        "tenant's run, which is answered exactly as an unknown run (same message, nothing "
        "about its owner)",
    ),
    (EXIT_INTERRUPTED, "interrupted (^C)"),
    (EXIT_BROKEN_PIPE, "the reader closed the pipe (`runlog show RUN | head`)"),
)
