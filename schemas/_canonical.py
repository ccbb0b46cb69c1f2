"""Canonical JSON: the one serialisation of tool arguments that idempotency keys hash."""

from __future__ import annotations

import json
from typing import Any

from runlog.errors import ToolArgumentsError

MAX_ARGS_BYTES = 256 * 1024


def canonical_json(value: Any, *, limit: int = MAX_ARGS_BYTES) -> str:
    """Sorted keys, no whitespace, no NaN; raises ``ToolArgumentsError`` otherwise.

    ``{"amount": 10, "acct": "x"}`` and ``{"acct": "x", "amount": 10}`` are one action.
    """
    _refuse_non_str_keys(value)
    try:
        text = json.dumps(
            value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        )
        size = len(text.encode())
    except (TypeError, ValueError) as exc:  # UnicodeEncodeError (lone surrogate) included
        raise ToolArgumentsError(f"tool arguments are not canonical JSON: {exc}") from exc
    if size > limit:
        raise ToolArgumentsError(f"tool arguments are {size} bytes, over the {limit}-byte limit")
    return text


def _refuse_non_str_keys(value: Any, depth: int = 0) -> None:
    """JSON would turn ``{1: x}`` into ``{"1": x}`` silently: two argument sets, one key."""
    if depth > 100:
        raise ToolArgumentsError("tool arguments are nested more than 100 levels deep")
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ToolArgumentsError(
                    f"tool arguments are not canonical JSON: key {k!r} is a "
                    f"{type(k).__name__}, not a string"
                )
            _refuse_non_str_keys(v, depth + 1)
    elif isinstance(value, list | tuple):
        for v in value:
            _refuse_non_str_keys(v, depth + 1)
