"""Decoding a record whose content fields may be sealed: a record that holds no sealed value
does not visit the sealing code at all, and one that holds any has every sealed value
opened, top-level or nested, plaintext beside it untouched."""

from __future__ import annotations

from typing import Any

import pytest
from codec_support import make_event

from runlog.schemas import _codec as codec
from runlog.schemas._sealing import SEALED_FIELDS, Sealed, top_level
from runlog.schemas._vocabulary import EventType


class _Reversing:
    """Seals by reversing the text (not a cipher: the decoder is under test) and counts the
    values it is asked to open."""

    def __init__(self) -> None:
        self.opened = 0

    def seal(self, plaintext: str, aad: bytes) -> Sealed:
        return Sealed("k-test", b"\0" * 12, plaintext.encode()[::-1])

    def open(self, key_id: str, nonce: bytes, ciphertext: bytes, aad: bytes) -> str | None:
        self.opened += 1
        return bytes(ciphertext)[::-1].decode()


@pytest.fixture
def spied(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every call of the sealing module's record opener made by the decoder."""
    calls: list[Any] = []
    real = codec.open_record

    def spy(*args: Any) -> bool:
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(codec, "open_record", spy)
    return calls


def _message(content: str) -> Any:
    return make_event(EventType.USER_MESSAGE, {"content": content}, run_id="r-sealed", seq=2)


def test_a_plaintext_record_skips_the_sealing_code(spied: list[Any]) -> None:
    keys = _Reversing()
    ev = codec.decode(codec.encode(_message("hello")), opener=keys)
    assert ev.payload.content == "hello"
    assert spied == [] and keys.opened == 0


def test_a_sealed_record_is_opened(spied: list[Any]) -> None:
    keys = _Reversing()
    ev = codec.decode(codec.encode(_message("secret"), sealer=keys), opener=keys)
    assert ev.payload.content == "secret"
    assert len(spied) == 1 and keys.opened == 1


def test_a_type_with_a_nested_content_field_always_looks(spied: list[Any]) -> None:
    """MODEL_TURN's tool calls carry sealed arguments inside a list: the decoder cannot tell
    from the top-level fields alone, so it asks the sealing code, which opens what it finds."""
    assert not top_level(SEALED_FIELDS[EventType.MODEL_TURN])
    assert top_level(SEALED_FIELDS[EventType.USER_MESSAGE])
    turn = make_event(
        EventType.MODEL_TURN,
        {
            "text": "thinking",
            "tool_calls": [{"call_id": "c1", "name": "pay", "args_json": '{"amount": 5}'}],
        },
        run_id="r-sealed",
        seq=3,
    )
    keys = _Reversing()
    plain = codec.decode(codec.encode(turn), opener=keys)
    assert plain.payload.tool_calls[0].args_json == '{"amount": 5}' and keys.opened == 0
    sealed = codec.decode(codec.encode(turn, sealer=keys), opener=keys)
    assert sealed.payload.text == "thinking"
    assert sealed.payload.tool_calls[0].args_json == '{"amount": 5}'
    assert keys.opened == 2  # the text and the tool call's arguments (no response_json)
    assert len(spied) == 2
