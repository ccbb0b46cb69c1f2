"""The compiled Avro readers read exactly what fastavro reads, and refuse what it refuses.

(One deliberate difference: a negative union branch, which fastavro reads as an index
from the end of the branch list, is refused.)

``schemas._compiled`` replaces fastavro on the decode path of current schema versions, so
it must agree with it on every byte string: valid records of every released schema, and
the same records truncated, bit-flipped or replaced by noise. Then ``codec.decode`` gives
the same events (or the same error class) either way.
"""

from __future__ import annotations

import io
import random
import threading
import time
from typing import Any

import fastavro
import fastavro.utils
import pytest
from codec_support import make_event

from runlog.errors import SchemaError
from runlog.schemas import _codec as codec
from runlog.schemas import _compiled as compiled
from runlog.schemas._registry import registry
from runlog.schemas._vocabulary import EventType


def _fastavro(schema: Any, body: bytes) -> tuple[str, Any]:
    try:
        return "ok", fastavro.schemaless_reader(io.BytesIO(body), schema)
    except Exception as exc:  # noqa: BLE001 - only whether it refused matters
        return "error", type(exc).__name__


def _compiled(read: compiled.Reader, body: bytes) -> tuple[str, Any]:
    try:
        return "ok", read(body, 0)[0]
    except Exception as exc:  # noqa: BLE001
        return "error", type(exc).__name__


SCHEMAS = sorted(registry().by_fingerprint.values(), key=lambda w: (w.event_type.value, w.version))


@pytest.mark.parametrize("ws", SCHEMAS, ids=lambda w: f"{w.event_type.value}-v{w.version}")
def test_compiled_reader_agrees_with_fastavro(ws: Any) -> None:
    read = compiled.compile_reader(ws.parsed)
    rng = random.Random(ws.fingerprint)
    bodies: list[bytes] = []
    for rec in fastavro.utils.generate_many(ws.parsed, 40):
        buf = io.BytesIO()
        fastavro.schemaless_writer(buf, ws.parsed, rec)
        bodies.append(buf.getvalue())
    hostile: list[bytes] = []
    for body in bodies[:10]:
        hostile += [body[:n] for n in range(len(body))]
        for _ in range(30):
            flipped = bytearray(body)
            flipped[rng.randrange(len(body))] ^= 1 << rng.randrange(8)
            hostile.append(bytes(flipped))
    hostile += [rng.randbytes(rng.randrange(1, 80)) for _ in range(300)]
    hostile += [b"\x02\x03", b"\x80" * 12, b"\x01", b"\xff" * 3]
    for body in bodies:
        assert _compiled(read, body) == _fastavro(ws.parsed, body)
    for body in hostile:
        got, want = _compiled(read, body), _fastavro(ws.parsed, body)
        if want[0] == "error":
            assert got[0] == "error", (body, got)
        elif got[0] == "ok":
            assert got == want, body
        # else: stricter than fastavro, which takes a negative union branch as an index
        # from the end of the branch list; such bytes were never written by an encoder.


def test_every_current_schema_has_a_compiled_decoder() -> None:
    """A schema the compiler cannot take silently costs the slow path: say so here."""
    reg = registry()
    for ws in reg.by_fingerprint.values():
        if ws.version == reg.current[ws.event_type]:
            assert codec._compiled(ws) is not None, ws.event_type


def test_decode_matches_the_validating_path() -> None:
    """On valid and hostile records alike: the same event, or the same error class."""
    from tools.benchmarks.common import encode_all, make_events

    rng = random.Random(7)
    values = [r.value for r in encode_all(make_events("compiled-check", 400))]
    cases = list(values)
    for v in values[:40]:
        cases += [v[:n] for n in range(10, len(v), 3)]
        for _ in range(20):
            b = bytearray(v)
            b[rng.randrange(10, len(v))] = rng.randrange(256)
            cases.append(bytes(b))

    def slow(v: bytes) -> Any:
        ws, body = codec._framed(v, None)
        return codec._decode_slow(ws, v[body:])

    for v in cases:
        outcomes = []
        for fn in (codec.decode, slow):
            try:
                outcomes.append(("ok", fn(v)))
            except SchemaError as exc:
                outcomes.append(("error", type(exc).__name__))
        assert outcomes[0] == outcomes[1], v


def test_threads_decoding_a_type_for_the_first_time_at_once_compile_it_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A burst of opens that each read a run's log decodes each type first on many threads
    at once. One compiles its decoder and all use it: a compilation per thread held the
    interpreter's lock for each (as the registry's load did, ``test_registry_writers``)."""
    data = codec.encode(
        make_event(EventType.USER_MESSAGE, {"content": "hi"}, run_id="r-burst", seq=1)
    )
    calls: list[int] = []
    real = compiled.compile_reader

    def counting(parsed: Any) -> Any:
        calls.append(1)
        time.sleep(0.02)  # a compilation as slow as on a loaded machine: others arrive
        return real(parsed)

    monkeypatch.setattr(compiled, "compile_reader", counting)
    monkeypatch.setattr(codec, "_COMPILED", {})
    monkeypatch.setattr(codec, "_BY_HEADER", {})
    threads, gate, got = 16, threading.Barrier(16), []

    def decode() -> None:
        gate.wait()
        got.append(codec.decode(data))

    workers = [threading.Thread(target=decode) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert len(got) == threads and all(ev.payload.content == "hi" for ev in got)
    assert len(calls) == 1
