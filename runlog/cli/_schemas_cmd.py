"""``runlog schemas register|check``: the released schemas in a Confluent-compatible registry."""

from __future__ import annotations

import argparse
from typing import Any

from runlog._settings import Settings
from runlog.cli._groups import command_group
from runlog.errors import ConfigError
from runlog.log._registry import ids_for, subject_for
from runlog.schemas._registry import registry


def register(subparsers: Any) -> None:
    sub = command_group(
        subparsers, "schemas", help="register or check runlog's schemas in the schema registry"
    )
    p_reg = sub.add_parser(
        "register",
        help="register every released version (BACKWARD compatibility; idempotent)",
    )
    p_reg.set_defaults(func=_register)
    p_check = sub.add_parser(
        "check", help="every released version is registered under its subject (exit 1 if not)"
    )
    p_check.set_defaults(func=_check)


def _ids(settings: Settings) -> Any:
    ids = ids_for(settings)
    if ids is None:
        raise ConfigError("no schema registry configured: set RUNLOG_SCHEMA_REGISTRY_URL")
    return ids


def _register(args: argparse.Namespace) -> int:
    settings = Settings()
    for subject, version, schema_id in _ids(settings).register_all():
        print(f"{subject} v{version}: id {schema_id}")
    return 0


def _check(args: argparse.Namespace) -> int:
    settings = Settings()
    ids = _ids(settings)
    missing = 0
    for (et, version), ws in sorted(
        registry().by_type_version.items(), key=lambda i: i[0][0].value
    ):
        try:
            schema_id = ids.id_for(ws)
        except Exception as exc:  # noqa: BLE001 - report every missing version, then fail
            missing += 1
            print(f"MISSING {subject_for(settings.events_topic, et)} v{version}: {exc}")
            continue
        print(f"ok      {subject_for(settings.events_topic, et)} v{version}: id {schema_id}")
    return 1 if missing else 0
