"""What runlog records about an effect that happened is always encodable and says if it was cut.

``runlog.producers._bounds`` (docs/concepts/effects.md, "What records an effect is bounded
and sanitised"): a text over its byte budget is cut and ends with
``[runlog: cut N of M bytes; sha256 H of the whole text; kept at REF]``, a lone surrogate
becomes its ``\\udxxx`` escape, and a failing result sink never blocks the completion.
"""

from __future__ import annotations

import hashlib
import logging
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runlog.producers._bounds import (
    BOUNDED_FIELDS,
    CONTENT_BYTES,
    CUT_MARK,
    DETAIL_BYTES,
    TEXT_BYTES,
    bound_payload,
    bound_result,
    bound_text,
    needs_bounding,
    sanitise,
)
from runlog.schemas._vocabulary import EventType

MARKER = re.compile(
    re.escape("\n" + CUT_MARK) + r" (\d+) of (\d+) bytes; sha256 ([0-9a-f]{64}) of the whole text"
    r"(?:; kept at (.*))?\]\Z",
    re.DOTALL,
)
KiB = 1024

# Any code point, lone surrogates and 4-byte characters made likely, repeated so that many
# examples exceed a budget of a few KiB.
_any_char = st.one_of(
    st.characters(exclude_categories=()),
    st.characters(categories=["Cs"]),
    st.characters(min_codepoint=0x1F600, max_codepoint=0x1F64F),
)
# No lone surrogates: text that is valid UTF-8 as it is.
_valid_char = st.characters(exclude_categories=["Cs"])


def _long(chars: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    # st.lists, not st.text: st.text leaves lone surrogates out whatever its alphabet.
    chunk = st.lists(chars, max_size=200).map("".join)
    return st.builds(lambda s, n: s * n, chunk, st.integers(1, 200))


limits = st.integers(512, 4 * KiB)


def _utf8(text: str) -> int:
    return len(text.encode("utf-8"))


def _split(out: str) -> tuple[str, re.Match[str]]:
    """A cut text's head and its marker."""
    m = MARKER.search(out)
    assert m is not None, f"no well-formed cut marker at the end of {out[-300:]!r}"
    return out[: m.start()], m


@settings(max_examples=200, deadline=None)
@given(text=_long(_valid_char), limit=limits)
def test_a_valid_text_within_its_budget_is_recorded_whole(text: str, limit: int) -> None:
    if _utf8(text) > limit:
        text = text.encode()[:limit].decode("utf-8", "ignore")
    assert not needs_bounding(text, limit)
    assert bound_text(text, limit) == text

    def sink(key: str, whole: str) -> str:
        raise AssertionError("a result recorded whole must not go to the sink")

    assert bound_result(text, "k", sink, limit) == text


@settings(max_examples=300, deadline=None)
@given(
    text=_long(_any_char),
    limit=limits,
    reference=st.none() | st.lists(_any_char, max_size=300).map("".join),
)
def test_a_bounded_text_always_encodes_and_never_exceeds_its_budget(
    text: str, limit: int, reference: str | None
) -> None:
    out = bound_text(text, limit, reference=reference)
    assert _utf8(out) <= limit  # strict UTF-8: no lone surrogate survives
    # needs_bounding is exactly "bound_text would change it".
    assert needs_bounding(text, limit) == (out != text)


@settings(max_examples=200, deadline=None)
@given(text=_long(_valid_char), limit=limits)
def test_a_cut_text_is_a_prefix_with_the_length_and_digest_of_the_whole(
    text: str, limit: int
) -> None:
    whole = text.encode("utf-8")
    if len(whole) <= limit:
        text += "é" * limit  # make it too long, with 2-byte characters at the cut
        whole = text.encode("utf-8")
    head, m = _split(bound_text(text, limit))
    cut, total, digest = int(m[1]), int(m[2]), m[3]
    assert text.startswith(head)
    assert total == len(whole)
    assert cut == total - _utf8(head)  # "cut N of M bytes": N is what is missing
    assert cut > 0
    assert digest == hashlib.sha256(whole).hexdigest()
    assert m[4] is None  # no reference given, none claimed


@settings(max_examples=200, deadline=None)
@given(text=_long(_any_char), limit=limits)
def test_a_cut_text_with_lone_surrogates_counts_n_and_m_in_the_same_bytes(
    text: str, limit: int
) -> None:
    """N and M count the whole text's bytes (a lone surrogate as its 3-byte encoding) even
    where the head holds escapes: the head is the sanitised form of a prefix of the text,
    cut between characters (never inside an escape), and N is M minus that prefix's bytes."""
    text += "\udc80" * limit  # too long, with lone surrogates at the cut
    whole = text.encode("utf-8", "surrogatepass")
    head, m = _split(bound_text(text, limit))
    cut, total = int(m[1]), int(m[2])
    assert total == len(whole) and 0 < cut <= total
    size, k = 0, 0  # the prefix of k characters whose sanitised form is as long as head
    while k < len(text) and size + len(sanitise(text[k])) <= len(head):
        size += len(sanitise(text[k]))
        k += 1
    assert sanitise(text[:k]) == head, f"the head {head[-40:]!r} is no sanitised prefix"
    assert cut == total - len(text[:k].encode("utf-8", "surrogatepass"))


def test_a_lone_surrogate_becomes_its_escape_and_keeps_its_identity_in_the_digest() -> None:
    assert sanitise("ok \u00e9\U0001f600") == "ok \u00e9\U0001f600"  # valid text untouched
    assert sanitise("a\ud800b") == "a\\ud800b"
    assert bound_text("a\udfffb", 512) == "a\\udfffb"
    assert needs_bounding("a\ud800b", 512)  # fits, but would not encode as it is

    # Two results that differ only in their lone surrogate are two different texts.
    one, other = "x" * 2000 + "\ud800", "x" * 2000 + "\ud801"
    _, m1 = _split(bound_text(one, 1024))
    _, m2 = _split(bound_text(other, 1024))
    assert m1[3] != m2[3]
    # M and H are of the whole text with each lone surrogate as its 3-byte encoding.
    assert int(m1[2]) == 2003
    assert m1[3] == hashlib.sha256(one.encode("utf-8", "surrogatepass")).hexdigest()


@pytest.mark.parametrize(
    ("et", "budgets"),
    [
        (EventType.TOOL_CALL_COMPLETED, {"content": 256 * KiB}),
        (EventType.TOOL_CALL_UNCERTAIN, {"error": 16 * KiB}),
        (EventType.RECONCILIATION_ATTEMPTED, {"evidence": 16 * KiB, "rule": 16 * KiB}),
        (
            EventType.APPROVAL_REQUESTED,
            {"reason": 16 * KiB, "last_error": 16 * KiB, "detail": 64 * KiB},
        ),
        (EventType.GUARDRAIL_TRIGGERED, {"detail": 16 * KiB}),
    ],
)
def test_each_bounded_field_is_cut_at_its_documented_budget(
    et: EventType, budgets: dict[str, int]
) -> None:
    in_kib = (CONTENT_BYTES // KiB, TEXT_BYTES // KiB, DETAIL_BYTES // KiB)
    assert in_kib == (256, 16, 64)
    assert BOUNDED_FIELDS[et] == budgets
    other = "y" * (CONTENT_BYTES * 2)  # a field runlog does not bound for this type
    payload: dict[str, Any] = {name: "x" * (budget + 1) for name, budget in budgets.items()}
    payload |= {"other": other, "count": 7}
    before = dict(payload)

    out = bound_payload(et, payload)
    for name, budget in budgets.items():
        assert _utf8(out[name]) <= budget, name
        head, _ = _split(out[name])
        assert _utf8(head) > budget // 2, f"{name}: cut far below its budget"
        # A text of exactly its budget is kept whole.
        exact = bound_payload(et, {name: "x" * budget})
        assert exact[name] == "x" * budget
    assert out["other"] == other and out["count"] == 7
    assert payload == before  # the caller's payload is not changed in place


def test_a_type_without_bounded_fields_and_non_text_values_are_left_alone() -> None:
    payload = {"content": "x" * (CONTENT_BYTES * 2)}
    assert bound_payload(EventType.USER_MESSAGE, payload) == payload
    odd = {"content": None, "error": 5}
    assert bound_payload(EventType.TOOL_CALL_COMPLETED, odd) == odd


def test_a_large_result_goes_whole_to_its_sink_and_its_reference_into_the_marker() -> None:
    kept: list[tuple[str, str]] = []

    def sink(key: str, whole: str) -> str:
        kept.append((key, whole))
        return f"s3://bucket/{key}"

    result = "r" * (CONTENT_BYTES + 10)
    out = bound_result(result, "k2_abc", sink)
    assert kept == [("k2_abc", result)]
    assert _utf8(out) <= CONTENT_BYTES
    _, m = _split(out)
    assert m[4] == "s3://bucket/k2_abc"
    assert int(m[2]) == len(result)


def test_a_failing_sink_never_loses_the_completion(caplog: pytest.LogCaptureFixture) -> None:
    def sink(key: str, whole: str) -> str:
        raise ConnectionError("blob store down")

    result = "r" * 5000
    with caplog.at_level(logging.WARNING, logger="runlog.producers._bounds"):
        out = bound_result(result, "k2_lost", sink, limit=1024)
    assert _utf8(out) <= 1024
    _, m = _split(out)
    assert m[4] is not None and "ConnectionError" in m[4] and "blob store down" in m[4]
    assert any("k2_lost" in r.getMessage() for r in caplog.records)
