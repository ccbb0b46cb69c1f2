"""What a printer shows of a payload: the fields a user marks secret replaced.

``RUNLOG_REDACT_FIELDS`` names fields (any case) whose values never print: not in
``runlog show``, the console, ``runlog uncertain`` or ``runlog audit``. The log itself keeps
what was written; every reader that hands payloads to a printer (the timeline, the
projections' queries) redacts through this module, so no printer has a rule of its own.
A field is found wherever it sits: in JSON, in JSON held inside a string value (a gateway's
``{"body": "{\\"card\\": ...}"}``), and in text that is not JSON (a result runlog cut,
evidence with a prefix, an error message) by its ``"field": value`` / ``field=value`` pattern.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from runlog._settings import Settings

REDACTED = "[redacted]"

NESTING = 8
"""How many levels of JSON held in string values are opened (``{"body": "{\"card\":..}"}``);
deeper text is still masked by field patterns."""


def redact_value(value: Any, secret: frozenset[str], depth: int = NESTING) -> Any:
    """``value`` with every dict entry whose key is in ``secret`` (any case) replaced, and
    every string redacted as text (``redact_text``): JSON inside it, or field patterns."""
    if isinstance(value, dict):
        return {
            k: REDACTED if k.lower() in secret else redact_value(v, secret, depth)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [redact_value(v, secret, depth) for v in value]
    if isinstance(value, str):
        return redact_text(value, secret, depth)
    return value


def redact_text(text: str, secret: frozenset[str], depth: int = NESTING) -> str:
    """``text`` with the values of ``secret`` fields replaced by ``[redacted]``.

    Text that is a JSON object or array is parsed and redacted field by field, with the JSON
    held in its string values (up to ``depth`` levels); it comes back as JSON (sorted keys)
    when anything was redacted, else unchanged. Any other text (a result runlog cut, which
    is no longer valid JSON, evidence with a prefix, a log line) has its ``"field": value``
    and ``field=value`` patterns masked, at any level of quoting, so a secret never shows
    because its JSON was cut or wrapped.
    """
    if not secret or not text:
        return text
    head = text.lstrip()[:1]
    if depth > 0 and head in ("{", "["):
        try:
            value = json.loads(text)
        except ValueError:
            pass
        else:
            if isinstance(value, dict | list):
                redacted = redact_value(value, secret, depth - 1)
                if redacted == value:
                    return text
                return json.dumps(redacted, sort_keys=True, ensure_ascii=False)
    return mask_fields(text, secret)


def redact_json(text: str | None, secret: frozenset[str]) -> str | None:
    """``redact_text`` for a field that may be absent: what every printer (``runlog show``,
    the console, the timeline) applies to arguments, results, evidence, details, errors."""
    if text is None:
        return text
    return redact_text(text, secret)


@functools.lru_cache(maxsize=64)
def _field_pattern(secret: frozenset[str]) -> re.Pattern[str]:
    names = "|".join(re.escape(f) for f in sorted(secret, key=len, reverse=True))
    # A key: the name, not inside a longer identifier, quoted at any escaping level (the
    # same quote after it) or bare; then ``:`` or ``=``.
    return re.compile(
        r"(?P<q>(?:\\{0,63}[\"'])?)(?<![\w-])(?:" + names + r")(?![\w-])(?P=q)\s*[:=]\s*",
        re.IGNORECASE,
    )


_QUOTE = re.compile(r"(\\*)([\"'])")
"""A quoted value's opening quote, with the backslashes that escape it at its level."""

_BARE = re.compile(r"[^\s,;&}\])\"'\\]+(?:[ -]\d+)*")
"""An unquoted value: up to a delimiter (digit groups split by spaces or dashes stay one)."""


def _quoted_end(text: str, start: int, quote: str, level: int) -> tuple[int, bool]:
    """Where the string value opened at ``start`` (its quote preceded by ``level``
    backslashes) ends, and whether it was closed: at the first ``quote`` escaped exactly
    ``level`` times, or the end of the line (a cut text, or a quote of an outer level)."""
    i = start
    while i < len(text):
        ch = text[i]
        if ch == "\n":
            return i, False
        if ch == quote:
            n = 0
            while i - n - 1 >= start and text[i - n - 1] == "\\":
                n += 1
            if n == level:
                return i + 1, True
            if n < level:
                return i - n, False
        i += 1
    return len(text), False


def _nested_end(text: str, start: int) -> int:
    """The end of a ``{...}`` or ``[...]`` value (brackets counted), or of its line."""
    depth = 0
    for i in range(start, len(text)):
        ch = text[i]
        if ch == "\n":
            return i
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


def mask_fields(text: str, secret: frozenset[str]) -> str:
    """``text`` (not JSON) with the value after each ``field:`` / ``field=`` of a ``secret``
    field replaced by ``[redacted]``, keeping the value's quoting."""
    if not secret:
        return text
    out: list[str] = []
    pos = 0
    for key in _field_pattern(secret).finditer(text):
        if key.start() < pos:
            continue  # inside a value already masked
        i = key.end()
        out.append(text[pos:i])
        quoted = _QUOTE.match(text, i)
        if quoted:
            opener = quoted.group(0)
            end, closed = _quoted_end(text, i + len(opener), quoted.group(2), len(quoted.group(1)))
            out.append(opener + REDACTED + (opener if closed else ""))
        elif text[i : i + 1] in ("{", "["):
            end = _nested_end(text, i)
            out.append(REDACTED)
        else:
            bare = _BARE.match(text, i)
            end = bare.end() if bare else i
            out.append(REDACTED if bare else "")
        pos = end
    if not out:
        return text
    out.append(text[pos:])
    return "".join(out)


def secret_fields(settings: Settings) -> frozenset[str]:
    return frozenset(f.lower() for f in settings.redact_fields)


def redact_entry(entry: dict[str, Any], secret: frozenset[str]) -> dict[str, Any]:
    """A projection's record (an audit entry, an uncertain call) as a printer may show it."""
    if not secret:
        return entry
    redacted: dict[str, Any] = redact_value(entry, secret)
    return redacted
