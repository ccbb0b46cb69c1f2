"""The ``runlog`` command line. Each area registers its subcommands from its own module."""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
from collections.abc import Sequence

from runlog.errors import RunlogError

# Modules that define ``register(subparsers)``; each owns its subcommands.
_COMMAND_MODULES = (
    "runlog.cli.stack_cmd",
    "runlog.cli.topics_cmd",
    "runlog.cli.runs_cmd",
    "runlog.cli.projections_cmd",
    "runlog.cli.operator_cmd",
    "runlog.cli.replay_cmd",
    "runlog.cli.records_cmd",
    "runlog.cli.schemas_cmd",
    "runlog.cli.bench_cmd",
    "runlog.cli.demo_cmd",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="runlog",
        description="Durable, fenced, replayable event logs for AI-agent runs on Kafka and "
        "Redis. `runlog COMMAND --help` for each command; README.md has the guide.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name in _COMMAND_MODULES:
        module = importlib.import_module(name)
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        rc: int = args.func(args)
        sys.stdout.flush()  # inside the try: a closed pipe may only show at this flush
    except BrokenPipeError:
        return _reader_went_away()
    except RunlogError as exc:
        print(f"runlog: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return rc


def _reader_went_away() -> int:
    """``runlog show RUN | head``: the reader closed the pipe; stop quietly, as a command
    killed by SIGPIPE does (128 + 13), instead of a traceback. Standard output is pointed at
    /dev/null so the interpreter's own flush at exit does not fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
