"""``python -m runlog.demo [run|ledger|worker]``: the demo's processes (default: ``run``)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from runlog.demo import agent, ledger, supervisor

COMMANDS = ("run", "ledger", "worker")


def build_parser(prog: str = "python -m runlog.demo") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    add_subcommands(parser)
    return parser


def add_subcommands(parser: argparse.ArgumentParser) -> None:

    sub = parser.add_subparsers(dest="demo_command")
    entries: tuple[tuple[str, str, Callable[[argparse.ArgumentParser], None], object], ...] = (
        (
            "run",
            "the supervised demo: kills, a pause, decisions, summary",
            supervisor.add_arguments,
            supervisor.run,
        ),
        ("ledger", "the ledger service (its own process)", ledger.add_arguments, ledger.run),
        ("worker", "one reconciliation-agent worker", agent.add_arguments, agent.run),
    )
    for name, help_text, add, func in entries:
        p = sub.add_parser(name, help=help_text)
        add(p)
        p.set_defaults(demo_func=func)


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if not args_list or (args_list[0] not in COMMANDS and args_list[0] not in ("-h", "--help")):
        args_list.insert(0, "run")
    args = build_parser().parse_args(args_list)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    func: Callable[[argparse.Namespace], int] = args.demo_func
    return func(args)


if __name__ == "__main__":
    sys.exit(main())
