"""The compiled Avro encoders write exactly what fastavro writes, for every released schema.

A writer encodes each event with its type's compiled encoder (``schemas/_compiled.py``);
fastavro is the reference. These tests encode the same events both ways: the sample event
of every type, then events whose payloads and envelopes are drawn from the Avro schema
itself (any unicode, integers at their range ends, nulls, empty and multi-block
collections, times before 1970), and check the bytes are equal, that the compiled path
(not the fallback) wrote them, and that a value the compiled encoder refuses still gets
fastavro's answer.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from codec_support import make_event
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from test_codec import sample_event

from runlog.errors import ValidationFailed
from runlog.schemas import _codec as codec
from runlog.schemas._models import Event
from runlog.schemas._registry import registry
from runlog.schemas._sealing import SEALED_FIELDS, Sealed, View, plain_view, seal_payload
from runlog.schemas._vocabulary import EventType

EXAMPLES = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))


def compiled(ev: Event) -> bytes:
    """``ev`` written by its compiled encoder alone (no fallback), as ``encode`` frames it."""
    ws = registry().writer(ev.type)
    assert ws.encoder is not None, f"{ev.type.value} v{ws.version} has no compiled encoder"
    out = bytearray(codec.MAGIC + ws.fingerprint)
    ws.encoder(ev, out)
    return bytes(out)


@pytest.mark.parametrize("et", list(EventType), ids=lambda et: et.value)
def test_every_type_is_encoded_by_its_compiled_encoder_as_fastavro_does(et: EventType) -> None:
    ev = sample_event(et, "r-avro", 7)
    assert compiled(ev) == codec.encode_with_fastavro(ev) == codec.encode(ev)
    assert codec.decode(codec.encode(ev)) == ev


# Where a zig-zag varint grows a byte, and the ends of the ranges.
EDGES = [0, 1, 31, 32, 63, 64, 65, 127, 128, 8191, 8192, 2**31 - 1, 2**53, 2**63 - 1]
EDGE_INTS = st.sampled_from(EDGES + [-n for n in EDGES] + [-(2**31), -(2**63)])


def _ints(bits: int) -> st.SearchStrategy[int]:
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    return st.one_of(
        st.integers(lo, hi), st.integers(-300, 300), EDGE_INTS.filter(lambda n: lo <= n <= hi)
    )


TEXTS = st.one_of(
    st.text(),
    st.text(min_size=60, max_size=300),
    st.sampled_from([31, 32, 63, 64, 65, 127, 128, 8192]).map(lambda n: "x" * n),
)


def _from_avro(schema: Any) -> st.SearchStrategy[Any]:
    """Values of an Avro type as a payload model takes them."""
    if isinstance(schema, list):
        return st.one_of(*(_from_avro(b) for b in schema))
    if isinstance(schema, dict):
        kind = schema["type"]
        if schema.get("logicalType") == "timestamp-micros":
            return st.datetimes(
                min_value=datetime(1901, 1, 1),
                max_value=datetime(2200, 1, 1),
                timezones=st.just(UTC),
            )
        if kind == "record":
            return st.fixed_dictionaries(
                {f["name"]: _from_avro(f["type"]) for f in schema["fields"]}
            )
        if kind == "array":
            return st.lists(_from_avro(schema["items"]), max_size=70)  # past one varint byte
        if kind == "map":
            return st.dictionaries(st.text(max_size=8), _from_avro(schema["values"]), max_size=4)
        return _from_avro(kind)
    return {
        "null": st.none(),
        "string": TEXTS,
        "long": _ints(64),
        "int": _ints(32),
        "boolean": st.booleans(),
        "double": st.floats(allow_nan=False),
    }[schema]


def _payload_schema(et: EventType) -> Any:
    """The payload's schema as the model holds it: content fields as plaintext."""
    parsed = registry().writer(et).parsed
    return plain_view(next(f["type"] for f in parsed["fields"] if f["name"] == "payload"))


@st.composite
def drawn_events(draw: st.DrawFn) -> Event:
    et = draw(st.sampled_from(list(EventType)))
    payload = draw(_from_avro(_payload_schema(et)))
    try:
        return make_event(
            et,
            payload,
            run_id=draw(TEXTS.filter(bool)),
            seq=draw(_ints(64).filter(lambda n: n >= 1)),
            epoch=draw(_ints(64).filter(lambda n: n >= 1)),
            tenant=draw(st.text(min_size=1, max_size=20)),
            writer_id=draw(st.text(max_size=40)),
            occurred_at=draw(
                st.datetimes(min_value=datetime(1901, 1, 1), timezones=st.just(UTC))
            ).replace(microsecond=draw(st.integers(0, 999_999))),
        )
    except ValidationFailed:
        assume(False)  # the payload model refuses it: no writer would encode it
        raise


@EXAMPLES
@given(drawn_events())
def test_drawn_events_are_encoded_as_fastavro_does(ev: Event) -> None:
    assert compiled(ev) == codec.encode_with_fastavro(ev)


@pytest.mark.parametrize("n", [n for n in EDGES if n >= 1])
def test_lengths_and_numbers_where_a_varint_grows_are_encoded_as_fastavro_does(n: int) -> None:
    ev = make_event(
        EventType.USER_MESSAGE, {"content": "é" * min(n, 9000)}, run_id="r" * min(n, 300), seq=n
    )
    assert compiled(ev) == codec.encode_with_fastavro(ev)


def test_a_value_the_compiled_encoder_refuses_gets_fastavros_answer() -> None:
    ev = sample_event(EventType.USER_MESSAGE, "r-avro", 3)
    # A string where the schema says long: fastavro refuses it, and so does encode.
    odd = ev.model_copy(update={"seq": "3"})
    with pytest.raises(TypeError):
        compiled(odd)
    with pytest.raises(ValidationFailed, match="does not fit its Avro schema"):
        codec.encode(odd)
    # A bool where the schema says long: the compiled encoder takes only ints, fastavro
    # writes it as 1; encode gives fastavro's bytes.
    odd = ev.model_copy(update={"epoch": True})
    with pytest.raises(TypeError):
        compiled(odd)
    assert codec.encode(odd) == codec.encode_with_fastavro(odd)


def test_odd_values_a_payload_model_lets_through_are_encoded_as_fastavro_does() -> None:
    """Floats that are not numbers, a negative zero, a time in another zone and before 1970:
    the same bytes. A lone surrogate cannot be UTF-8: encode refuses it, naming the schema."""
    turn = make_event(
        EventType.MODEL_TURN, {"text": "t", "tool_calls": [], "cost_usd": 0.0}, run_id="r", seq=2
    )
    for cost in (math.nan, math.inf, -math.inf, -0.0, 5e-324, 1.7976931348623157e308):
        ev = turn.model_copy(update={"payload": turn.payload.model_copy(update={"cost_usd": cost})})
        assert compiled(ev) == codec.encode_with_fastavro(ev), cost
    zone = timezone(timedelta(hours=5, minutes=30))
    ev = make_event(
        EventType.USER_MESSAGE,
        {"content": "x"},
        run_id="r",
        seq=1,
        occurred_at=datetime(1950, 1, 1, 0, 0, 0, 1, tzinfo=zone),
    )
    assert compiled(ev) == codec.encode_with_fastavro(ev)
    ev = make_event(EventType.USER_MESSAGE, {"content": "a\ud800b"}, run_id="r", seq=1)
    with pytest.raises(ValidationFailed, match="does not fit its Avro schema"):
        codec.encode(ev)


class _CountingSealer:
    """A sealer whose output depends only on its input (the nonce counts), so two encoders
    given the same event write the same bytes. Not a cipher: the encoders are under test."""

    def __init__(self) -> None:
        self.n = 0

    def seal(self, plaintext: str, aad: bytes) -> Sealed:
        self.n += 1
        return Sealed("k-test", self.n.to_bytes(12, "big"), plaintext.encode()[::-1] + aad)


@EXAMPLES
@given(drawn_events())
def test_sealed_events_are_encoded_as_fastavro_does(ev: Event) -> None:
    """A content field's union (string | runlog.Sealed) is compiled too: the sealed payload
    is written by the compiled encoder exactly as fastavro writes the sealed dict."""
    paths = SEALED_FIELDS.get(ev.type, ())
    sealed = seal_payload(ev.payload, paths, _CountingSealer(), ev.run_id, ev.seq)
    ws = registry().writer(ev.type)
    assert ws.encoder is not None
    out = bytearray(codec.MAGIC + ws.fingerprint)
    ws.encoder(View(ev, {"payload": sealed}), out)
    assert bytes(out) == codec.encode_with_fastavro(ev, sealer=_CountingSealer())
    assert codec.encode(ev, sealer=_CountingSealer()) == bytes(out)
