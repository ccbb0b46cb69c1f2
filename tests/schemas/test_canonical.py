"""Canonical JSON (``runlog.schemas._canonical``): the one text of a call's arguments that
its idempotency key hashes (docs/concepts/effects.md, "Side effects").

* One serialisation: sorted keys, no whitespace, non-ASCII text as itself; the text parses
  back to the arguments and is its own canonical form (a fixed point), so equal arguments
  always make one text.
* At most 256 KiB, counted in UTF-8 bytes (the bytes the key hashes), the limit itself
  allowed; over it, ``ToolArgumentsError`` naming the size and the limit.
* Keys are strings: a key of another type anywhere is refused naming the key and its type
  (JSON would turn ``{1: x}`` into ``{"1": x}`` silently).
* At most 100 levels of nesting; one more is refused.

Which values are refused at all (sets, NaN, objects, lone surrogates...) and key-order
independence: tests/security/test_hostile_input.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runlog.errors import RunlogError, ToolArgumentsError
from runlog.schemas._canonical import MAX_ARGS_BYTES, canonical_json

FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# JSON values as Python holds them (no NaN or infinity: those are refused; text without
# lone surrogates: those cannot be UTF-8).
_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | _text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_text, inner, max_size=4),
    max_leaves=20,
)


def test_the_text_is_compact_sorted_and_keeps_unicode_as_itself() -> None:
    args = {"b": "café ✓", "a": [1, {"d": 1.5, "c": None}], "A": True}
    assert canonical_json(args) == '{"A":true,"a":[1,{"c":null,"d":1.5}],"b":"café ✓"}'


@FAST
@given(json_values)
def test_the_text_parses_back_and_is_its_own_canonical_form(value: Any) -> None:
    text = canonical_json(value)
    assert json.loads(text) == value
    assert canonical_json(json.loads(text)) == text


def test_the_limit_counts_utf8_bytes_and_allows_the_limit_itself() -> None:
    # '{"s":""}' is 8 bytes: 12 more make exactly 20.
    assert len(canonical_json({"s": "x" * 12}, limit=20).encode()) == 20
    with pytest.raises(ToolArgumentsError) as err:
        canonical_json({"s": "x" * 13}, limit=20)
    assert "21" in str(err.value) and "20" in str(err.value)
    # 7 characters but 14 bytes of text: 22 bytes, over 20 although 15 characters long.
    with pytest.raises(ToolArgumentsError) as err:
        canonical_json({"s": "é" * 7}, limit=20)
    assert "22" in str(err.value) and "20" in str(err.value)


def test_the_default_limit_is_256_kib() -> None:
    assert MAX_ARGS_BYTES == 256 * 1024
    fits = {"s": "x" * (MAX_ARGS_BYTES - 8)}
    assert len(canonical_json(fits).encode()) == MAX_ARGS_BYTES
    with pytest.raises(ToolArgumentsError) as err:
        canonical_json({"s": "x" * (MAX_ARGS_BYTES - 7)})
    assert str(MAX_ARGS_BYTES) in str(err.value)


@pytest.mark.parametrize(
    ("args", "key", "kind"),
    [
        ({1: "x"}, "1", "int"),
        ({"a": [{"b": {2.5: "y"}}]}, "2.5", "float"),
        ({"ok": {True: 1}}, "True", "bool"),
        ({"t": [{(1, 2): 0}]}, "(1, 2)", "tuple"),
    ],
)
def test_a_key_that_is_not_a_string_is_refused_naming_it(args: Any, key: str, kind: str) -> None:
    with pytest.raises(ToolArgumentsError) as err:
        canonical_json(args)
    assert isinstance(err.value, RunlogError)
    assert key in str(err.value) and kind in str(err.value)


def _nested(levels: int) -> Any:
    """``levels`` containers, alternately lists and dicts, around a leaf."""
    value: Any = "leaf"
    for i in range(levels):
        value = [value] if i % 2 else {"k": value}
    return value


def test_100_levels_of_nesting_are_allowed_and_101_refused() -> None:
    assert json.loads(canonical_json(_nested(100))) == _nested(100)
    with pytest.raises(ToolArgumentsError) as err:
        canonical_json(_nested(101))
    assert "100" in str(err.value)
