"""``runlog topics create|check``: runlog's Kafka topics (see runlog._topics)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from runlog._security import ROLES, clients_authenticate
from runlog._settings import Settings
from runlog._topics import TopicsReport, check_topics, ensure_topics
from runlog.cli._groups import EXIT_FAILURE, EXIT_OK, command_group, print_json
from runlog.errors import ConfigError


def register(subparsers: Any) -> None:
    sub = command_group(subparsers, "topics", help="create or check runlog's Kafka topics")
    p_create = sub.add_parser(
        "create",
        help="create missing topics (idempotent); report drift of existing ones (exit 1)",
    )
    p_create.add_argument("--timeout", type=float, default=30.0)
    p_create.add_argument(
        "--acls",
        choices=("auto", "yes", "no"),
        default="auto",
        help="also set the least-privilege ACLs of runlog's roles (worker, projections, "
        "analytics, operator); auto: when RUNLOG_SECURITY_PROTOCOL authenticates clients "
        "(SASL_SSL, SASL_PLAINTEXT, SSL). Needs a super user.",
    )
    p_create.add_argument(
        "--principal",
        action="append",
        default=[],
        metavar="ROLE=PRINCIPAL",
        help="the principal of a role, e.g. worker=User:agents (default User:runlog-ROLE)",
    )
    p_create.add_argument("--json", action="store_true")
    p_create.set_defaults(func=_create)
    p_check = sub.add_parser(
        "check", help="report missing topics and drifted configs/partitions (exit 1 if any)"
    )
    p_check.add_argument("--timeout", type=float, default=30.0)
    p_check.add_argument("--json", action="store_true")
    p_check.set_defaults(func=_check)


def _finish(report: TopicsReport, *, as_json: bool) -> int:
    if as_json:
        print_json(report.to_dict())
    else:
        print(report.describe())
    if report.ok:
        return EXIT_OK
    print(
        "runlog topics: drift found; runlog never alters existing topics. Fix a config with "
        "kafka-configs; never add partitions to a live events topic (runs are located by "
        "hashing their id over the count they started with): grow a fleet on new topics "
        "(RUNLOG_TOPIC_PREFIX) instead, docs/howto/production.md, 'Growing a fleet'",
        file=sys.stderr,
    )
    return EXIT_FAILURE


def _create(args: argparse.Namespace) -> int:
    settings = Settings()
    principals: dict[str, str] = {}
    for item in args.principal:
        role, sep, principal = item.partition("=")
        if not sep or role not in ROLES or not principal.startswith("User:"):
            raise ConfigError(
                f"--principal {item!r}: expected ROLE=User:NAME with ROLE one of {', '.join(ROLES)}"
            )
        principals[role] = principal
    acls = args.acls == "yes" or (args.acls == "auto" and clients_authenticate(settings))
    report = ensure_topics(settings, timeout=args.timeout, acls=acls, principals=principals)
    return _finish(report, as_json=args.json)


def _check(args: argparse.Namespace) -> int:
    return _finish(check_topics(Settings(), timeout=args.timeout), as_json=args.json)
