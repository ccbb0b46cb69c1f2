"""``runlog keys new-kek|rotate``: key-encryption keys of sealed content (runlog.log._keys)."""

from __future__ import annotations

import argparse
from typing import Any

from runlog._settings import Settings
from runlog.cli._groups import EXIT_OK, command_group, print_json
from runlog.errors import NoKeys
from runlog.log._keys import key_store, new_kek, next_kek_id


def register(subparsers: Any) -> None:
    sub = command_group(
        subparsers, "keys", help="key-encryption keys of sealed content (docs: encryption)"
    )
    p = sub.add_parser(
        "new-kek",
        help="print a fresh KEK as KEK_ID:BASE64 (append it to RUNLOG_KEK, then rotate)",
        description=(
            "Prints a fresh 32-byte key-encryption key as KEK_ID:BASE64, the form RUNLOG_KEK "
            "takes. KEK_ID defaults to k<N+1> after the highest k<N> that RUNLOG_KEK (or "
            "RUNLOG_KEK_FILE) configures, k1 when none is. Nothing is stored: append the "
            "line to RUNLOG_KEK (the last KEK wraps new data keys), then `runlog keys rotate`."
        ),
    )
    p.add_argument(
        "kek_id",
        nargs="?",
        default=None,
        type=_kek_id,
        help="the new KEK's id, e.g. k2 (default: the next k<N> after those configured)",
    )
    p.set_defaults(func=_new_kek)
    p = sub.add_parser(
        "rotate",
        help="re-wrap every live data key under the last KEK of RUNLOG_KEK; afterwards the "
        "older KEKs (and backups of the keys topic wrapped by them) may be destroyed",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_rotate)


def _kek_id(text: str) -> str:
    """A KEK id is written before ``:`` in a list split at ``,`` and newlines."""
    if not text.strip() or any(c in text for c in ":,#") or text != text.strip():
        raise argparse.ArgumentTypeError(
            f"{text!r}: a KEK id is a non-empty word without ':', ',', '#' or spaces"
        )
    return text


def _new_kek(args: argparse.Namespace) -> int:
    kek_id = args.kek_id or next_kek_id(Settings())
    print(f"{kek_id}:{new_kek()}")
    return EXIT_OK


def _rotate(args: argparse.Namespace) -> int:
    settings = Settings()
    if settings.kek is None and not settings.kek_file:
        raise NoKeys("runlog keys rotate needs RUNLOG_KEK or RUNLOG_KEK_FILE")
    store = key_store(settings)
    try:
        n = store.rotate()
        kek = store.keks.current
    finally:
        store.close()
    if args.json:
        print_json({"rewrapped": n, "kek_id": kek})
    else:
        print(f"runlog keys: {n} data key(s) re-wrapped under KEK {kek}")
    return EXIT_OK
