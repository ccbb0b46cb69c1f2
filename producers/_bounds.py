"""Bounding and sanitising the text runlog records about effects that already happened.

A tool's result, error, a reconciler's evidence and an escalation's detail come from the
outside world: any length, any code points. Once an effect has happened its completion
must be recordable, or the log shows a start without a completion and recovery runs the
effect again. So before these fields are appended they are made valid UTF-8 (a lone
surrogate becomes its ``\\udxxx`` escape) and cut to a byte budget, with the SHA-256 and
the length of the whole text in a marker, so a reader can tell a cut text from a whole one
and check a copy kept elsewhere against it.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from typing import Any

from runlog.schemas._vocabulary import EventType

log = logging.getLogger(__name__)

CONTENT_BYTES = 256 * 1024
"""A tool result: generous for a model's context, far below an event's 900 KB budget."""

TEXT_BYTES = 16 * 1024
"""An error, a piece of evidence, a reason: diagnostics, not payloads."""

DETAIL_BYTES = 64 * 1024
"""An escalation's detail holds both payloads of a conflict."""

CUT_MARK = "[runlog: cut"
"""Every cut text ends with a marker starting with this (see ``bound_text``)."""

ResultSink = Callable[[str, str], str]
"""``sink(idempotency_key, whole_text) -> reference``: keeps a result runlog will cut."""

# Fields runlog bounds on every append of these types, whoever built the payload: the
# last line of defence, so a completion (or an escalation a person must answer) never
# fails to encode. The values are the byte budget of each field.
BOUNDED_FIELDS: dict[EventType, dict[str, int]] = {
    EventType.TOOL_CALL_COMPLETED: {"content": CONTENT_BYTES},
    EventType.TOOL_CALL_UNCERTAIN: {"error": TEXT_BYTES},
    EventType.RECONCILIATION_ATTEMPTED: {"evidence": TEXT_BYTES, "rule": TEXT_BYTES},
    EventType.APPROVAL_REQUESTED: {
        "reason": TEXT_BYTES,
        "last_error": TEXT_BYTES,
        "detail": DETAIL_BYTES,
    },
    EventType.GUARDRAIL_TRIGGERED: {"detail": TEXT_BYTES},
}


def _whole_bytes(text: str) -> bytes:
    # surrogatepass keeps a lone surrogate's identity in the digest: two results that
    # differ only there must not share a digest.
    return text.encode("utf-8", "surrogatepass")


def sanitise(text: str) -> str:
    """``text`` as valid UTF-8: each lone surrogate replaced by its backslash escape."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def needs_bounding(text: str, limit: int) -> bool:
    """True when ``bound_text`` would change ``text`` (cut it or escape a surrogate)."""
    try:
        return len(text.encode("utf-8")) > limit
    except UnicodeEncodeError:
        return True


def bound_text(text: str, limit: int, *, reference: str | None = None) -> str:
    """``text`` sanitised and, if its UTF-8 form exceeds ``limit`` bytes, cut.

    A cut text ends with ``[runlog: cut N of M bytes; sha256 H of the whole text; ...]``:
    M is the UTF-8 length of the whole text (lone surrogates counted as their 3-byte
    encoding), H its SHA-256 (same bytes), and ``reference`` where its keeper put it.
    The result's UTF-8 form never exceeds ``limit`` bytes (for ``limit`` >= 512).
    """
    clean = sanitise(text)
    encoded = clean.encode("utf-8")
    if len(encoded) <= limit:
        return clean
    whole = _whole_bytes(text)
    kept_at = f"; kept at {sanitise(reference)[:256]}" if reference else ""
    marker = (
        f"\n{CUT_MARK} {{cut}} of {len(whole)} bytes; "
        f"sha256 {hashlib.sha256(whole).hexdigest()} of the whole text{kept_at}]"
    )
    room = max(0, limit - len(marker.encode("utf-8")) - 16)
    if clean is text:  # no lone surrogate: the whole text's bytes are the ones kept
        head = encoded[:room].decode("utf-8", "ignore")  # never half a character
        cut = len(encoded) - len(head.encode("utf-8"))
    else:
        head, kept = _escaped_head(text, room)
        cut = len(whole) - kept
    return head + marker.replace("{cut}", str(cut))


def _escaped_head(text: str, room: int) -> tuple[str, int]:
    """The longest prefix of ``text`` whose sanitised UTF-8 form fits ``room`` bytes, cut
    between characters (never inside a surrogate's escape), sanitised; and that prefix's
    length in the marker's unit (``_whole_bytes``), so N and M count the same bytes."""
    lo, hi = 0, len(text)  # prefixes of lo characters fit; of more than hi, none do
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(sanitise(text[:mid]).encode("utf-8")) <= room:
            lo = mid
        else:
            hi = mid - 1
    return sanitise(text[:lo]), len(_whole_bytes(text[:lo]))


def bound_payload(et: EventType, payload: dict[str, Any]) -> dict[str, Any]:
    """``payload`` with the fields runlog bounds for ``et`` made safe to encode."""
    limits = BOUNDED_FIELDS.get(et)
    if not limits:
        return payload
    out = dict(payload)
    for name, limit in limits.items():
        value = out.get(name)
        if isinstance(value, str) and needs_bounding(value, limit):
            out[name] = bound_text(value, limit)
    return out


def bound_result(text: str, key: str, sink: ResultSink | None, limit: int = CONTENT_BYTES) -> str:
    """A tool's result (or a reconciler's ``Match.result``) ready for its completion.

    When it must be cut and the tool has a ``sink``, the sink receives the whole text
    first and its reference goes into the marker. A failing sink is logged and noted in
    the marker: the completion of an effect that happened is recorded regardless.
    """
    if not needs_bounding(text, limit):
        return text
    reference: str | None = None
    if sink is not None:
        try:
            reference = str(sink(key, text))
        except Exception as exc:  # noqa: BLE001 - a keeper's failure must not lose the completion
            log.warning("result sink for %s failed: %s", key, exc)
            reference = f"nowhere: the sink raised {type(exc).__name__}: {exc}"[:256]
    return bound_text(text, limit, reference=reference)
