"""The ``runlog`` command line. Each area registers its subcommands from its own module."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence

from runlog._settings import Settings
from runlog.cli._groups import (
    EXIT_BROKEN_PIPE,
    EXIT_CODES,
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_STACK_DOWN,
    EXIT_USAGE,
)
from runlog.errors import (
    InvalidRunId,
    InvalidTenant,
    KafkaUnavailable,
    RunlogError,
    UnknownApproval,
    UnknownRun,
)
from runlog.log import _kafka as kafka

# Modules that define ``register(subparsers)``; each owns its subcommands.
_COMMAND_MODULES = (
    "runlog.cli._stack_cmd",
    "runlog.cli._topics_cmd",
    "runlog.cli._runs_cmd",
    "runlog.cli._control_cmd",
    "runlog.cli._erasure_cmd",
    "runlog.cli._projections_cmd",
    "runlog.cli._operator_cmd",
    "runlog.cli._fork_cmd",
    "runlog.cli._diff_cmd",
    "runlog.cli._replay_cmd",
    "runlog.cli._records_cmd",
    "runlog.cli._schemas_cmd",
    "runlog.cli._keys_cmd",
    "runlog.cli._bench_cmd",
    "runlog.cli._demo_cmd",
    "runlog.cli._fleet_cmd",
)


# Commands that read or write the log: before anything else, they check that a broker
# answers at all, so a wrong address is one line at once, not librdkafka's retries first.
_NEEDS_KAFKA = frozenset(
    {
        "approve",
        "cancel",
        "diff",
        "explain",
        "fork",
        "reject",
        "replay",
        "show",
        "snapshot",
        "terminate",
        "verify",
        "rebuild",
        "topics",
        "start",
        "worker",
        "resume",
        "reconcile",
    }
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="runlog",
        description="Durable, fenced, replayable event logs for AI-agent runs on Kafka and "
        "Redis. `runlog COMMAND --help` for each command; the guide is in docs/ (make docs).",
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="also print librdkafka's own log lines (connection attempts, TLS, SASL)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name in _COMMAND_MODULES:
        module = importlib.import_module(name)
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error argparse printed (2)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    _configure_logging(verbose=args.verbose)
    try:
        if args.command in _NEEDS_KAFKA:
            _check_broker_answers()
        rc: int = args.func(args)
        sys.stdout.flush()  # inside the try: a closed pipe may only show at this flush
    except BrokenPipeError:
        return _reader_went_away()
    except UnknownRun as exc:
        # TenantMismatch is an UnknownRun: another tenant's run is answered exactly as a
        # run that does not exist, so the answer tells nothing about who owns the id.
        print(f"runlog: {_unknown_run(exc, args)}", file=sys.stderr)
        return EXIT_NOT_FOUND
    except UnknownApproval as exc:
        print(f"runlog: UnknownApproval: {exc}", file=sys.stderr)
        return EXIT_NOT_FOUND
    except (InvalidRunId, InvalidTenant) as exc:
        print(f"runlog: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except RunlogError as exc:
        print(f"runlog: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    return rc


def _unknown_run(exc: UnknownRun, args: argparse.Namespace) -> str:
    """One message for an unknown run and for another tenant's: the run id and the tenant
    asked for, never the exception's own text (which may differ between the two)."""
    run_id = exc.run_id or getattr(args, "run_id", None) or "?"
    tenant = getattr(args, "tenant", None)
    where = f" for tenant {tenant!r}" if isinstance(tenant, str) else ""
    return f"UnknownRun: no run {run_id}{where}"


__all__ = [
    "EXIT_BROKEN_PIPE",
    "EXIT_CODES",
    "EXIT_FAILURE",
    "EXIT_INTERRUPTED",
    "EXIT_NOT_FOUND",
    "EXIT_OK",
    "EXIT_STACK_DOWN",
    "EXIT_USAGE",
    "build_parser",
    "main",
]


def _reader_went_away() -> int:
    """``runlog show RUN | head``: the reader closed the pipe; stop quietly, as a command
    killed by SIGPIPE does (128 + 13), instead of a traceback. Standard output is pointed at
    /dev/null so the interpreter's own flush at exit does not fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_BROKEN_PIPE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())


def _configure_logging(*, verbose: bool) -> None:
    """Warnings of runlog's own to stderr; librdkafka's log lines only with ``--verbose``
    (what a failure means reaches the user as runlog's one-line error)."""
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    kafka.NATIVE_LOG = verbose  # as they come, to stderr; otherwise to a silenced logger
    kafka.KAFKA_LOG.setLevel(logging.CRITICAL + 1)


def _check_broker_answers() -> None:
    try:
        settings = Settings()
    except Exception:  # noqa: BLE001 - the command itself reports a bad setting, with its name
        return
    refused = kafka.unreachable(settings.bootstrap_servers)
    if refused is not None:
        raise KafkaUnavailable(
            f"no Kafka broker answers at {settings.bootstrap_servers} ({refused}); "
            "is RUNLOG_BOOTSTRAP_SERVERS right, and the stack up (`runlog stack status`)?"
        )
