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
    try:
        text = json.dumps(
            value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        )
    except (TypeError, ValueError) as exc:
        raise ToolArgumentsError(f"tool arguments are not canonical JSON: {exc}") from exc
    if len(text.encode()) > limit:
        raise ToolArgumentsError(
            f"tool arguments are {len(text.encode())} bytes, over the {limit}-byte limit"
        )
    return text
