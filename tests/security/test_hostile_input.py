"""Hostile input: bytes off the wire, out-of-order events, and tool arguments from a model.

* ``codec.decode`` either returns an event or raises a ``SchemaError`` subclass, whatever
  the bytes: random, truncated, bit-flipped, a wrong fingerprint, a huge declared length.
* The fold never raises on well-formed events in any order; every event is either
  applied or counted as a fenced write (nothing dropped), and invalid events leave the
  state exactly as the valid history made it.
* Tool arguments that are not canonical JSON, or too large, are refused with
  ``ToolArgumentsError`` before anything reaches the log.

The projection runner's quarantine of undecodable records on a real topic is covered by
``tests/consumers/runner/test_batch_quarantine.py`` (corrupt, truncated, unknown fingerprint, newer
version, invalid envelope, wrong type, wrong key), so it is not repeated here.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from codec_support import make_event
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from runlog._bootstrap import Services
from runlog._settings import Settings
from runlog.errors import SchemaError, ToolArgumentsError, UnknownEventType
from runlog.log._reader import LogReader
from runlog.producers._opening import open_run_with
from runlog.producers._tools import Tool
from runlog.projections._run_state import RunState, apply, fold, is_valid
from runlog.schemas import _codec as codec
from runlog.schemas._canonical import MAX_ARGS_BYTES, canonical_json
from runlog.schemas._keys import new_run_id
from runlog.schemas._models import Event
from runlog.schemas._vocabulary import EventType

FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
T0 = datetime(2024, 1, 1, tzinfo=UTC)


def _event(
    seq: int,
    epoch: int,
    et: EventType = EventType.USER_MESSAGE,
    *,
    run_id: str = "r-hostile",
    tenant: str = "acme",
    **payload: Any,
) -> Event:
    if et is EventType.USER_MESSAGE and not payload:
        payload = {"content": f"m{seq}"}
    return make_event(
        et,
        payload,
        run_id=run_id,
        seq=seq,
        epoch=epoch,
        tenant=tenant,
        writer_id=f"w{epoch}",
        event_id=f"{run_id}-{seq}-{epoch}-{et.value}-{random.random()}",
        occurred_at=T0 + timedelta(seconds=seq),
    )


def _decode_or_schema_error(data: bytes) -> Event | SchemaError:
    """Anything but an Event or a SchemaError escaping ``decode`` fails the test."""
    try:
        return codec.decode(data)
    except SchemaError as exc:
        return exc


def _samples() -> list[bytes]:
    """Valid encodings of every kind of payload we can build quickly."""
    evs = [
        _event(1, 1, EventType.RUN_STARTED, agent="a", goal="g"),
        _event(2, 1),
        _event(3, 2, EventType.RUN_RESUMED, previous_epoch=1, expected_prev_seq=2),
        _event(4, 2, EventType.RUN_FINISHED, outcome="completed", summary="s"),
    ]
    return [codec.encode(e) for e in evs]


SAMPLES = _samples()


# ---------------------------------------------------------------------------- codec


@FAST
@given(st.binary(max_size=512))
def test_random_bytes_never_escape_as_anything_but_schema_error(data: bytes) -> None:
    _decode_or_schema_error(data)


@FAST
@given(st.sampled_from(SAMPLES), st.binary(max_size=256))
def test_known_header_with_random_body_is_a_schema_error(good: bytes, body: bytes) -> None:
    got = _decode_or_schema_error(good[: codec.HEADER_LEN] + body)
    if isinstance(got, Event):  # a body that happens to decode must still be a valid event
        assert got.seq >= 0 or got.epoch >= 0


@FAST
@given(st.sampled_from(SAMPLES), st.data())
def test_truncated_records_are_corrupt(good: bytes, data: st.DataObject) -> None:
    cut = data.draw(st.integers(min_value=0, max_value=len(good) - 1))
    got = _decode_or_schema_error(good[:cut])
    assert isinstance(got, SchemaError), f"a {cut}-byte prefix decoded"


@FAST
@given(st.sampled_from(SAMPLES), st.data())
def test_flipped_bytes_decode_or_raise_schema_error(good: bytes, data: st.DataObject) -> None:
    buf = bytearray(good)
    for _ in range(data.draw(st.integers(min_value=1, max_value=4))):
        i = data.draw(st.integers(min_value=0, max_value=len(buf) - 1))
        buf[i] ^= data.draw(st.integers(min_value=1, max_value=255))
    _decode_or_schema_error(bytes(buf))


@FAST
@given(st.sampled_from(SAMPLES), st.binary(min_size=8, max_size=8))
def test_wrong_fingerprint_is_unknown_or_newer(good: bytes, fp: bytes) -> None:
    assume(fp not in codec.registry().by_fingerprint)
    got = _decode_or_schema_error(good[:2] + fp + good[codec.HEADER_LEN :])
    assert type(got).__name__ in {"UnknownFingerprint", "NewerSchemaVersion"}, got


def _zigzag(n: int) -> bytes:
    n = (n << 1) ^ (n >> 63)
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


@pytest.mark.parametrize("length", [2**62, 2**40, 2**31, -5, -(2**62)])
def test_huge_declared_lengths_fail_fast_without_allocating(length: int) -> None:
    """A hostile length prefix must not make the reader allocate or wait for it."""
    got = _decode_or_schema_error(SAMPLES[1][: codec.HEADER_LEN] + _zigzag(length) + b"x" * 16)
    assert isinstance(got, SchemaError)


def test_huge_payload_round_trips_and_type_mismatch_is_corrupt() -> None:
    big = _event(2, 1, content="x" * 3_000_000)
    assert codec.decode(codec.encode(big)).payload == big.payload
    # A record whose envelope names another type than its schema: refused, not guessed.
    started = SAMPLES[0]
    msg_fp = SAMPLES[1][2 : codec.HEADER_LEN]
    got = _decode_or_schema_error(started[:2] + msg_fp + started[codec.HEADER_LEN :])
    assert isinstance(got, SchemaError)


# ---------------------------------------------------------------------------- fold


def _history(n: int, resumes: list[int]) -> list[Event]:
    """A valid run: started, messages, resumptions at the given seqs, by rising epochs."""
    evs = [_event(1, 1, EventType.RUN_STARTED)]
    epoch = 1
    for seq in range(2, n + 1):
        if seq in resumes:
            epoch += 1
            evs.append(
                _event(
                    seq,
                    epoch,
                    EventType.RUN_RESUMED,
                    previous_epoch=epoch - 1,
                    expected_prev_seq=seq - 1,
                )
            )
        else:
            evs.append(_event(seq, epoch))
    return evs


histories = st.integers(min_value=1, max_value=25).flatmap(
    lambda n: st.tuples(
        st.just(n), st.lists(st.integers(min_value=2, max_value=max(2, n)), max_size=4)
    )
)


def _stripped(state: RunState) -> dict[str, Any]:
    d = state.to_dict()
    d.pop("fenced_writes")
    d.pop("max_epoch_seen")
    return d


@FAST
@given(histories, st.randoms(use_true_random=False))
def test_fold_never_raises_and_drops_nothing_in_any_order(
    h: tuple[int, list[int]], rnd: random.Random
) -> None:
    evs = _history(h[0], h[1])
    rnd.shuffle(evs)
    state = RunState()
    applied = 0
    for ev in evs:
        before = state.seq
        apply(state, ev)
        applied += state.seq != before
    assert applied + state.fenced_writes == len(evs)


def _hostile(valid: list[Event], rnd: random.Random) -> Event:
    """An event that must be invalid wherever it is inserted after the first one."""
    ref = rnd.choice(valid)
    top = max(e.epoch for e in valid)
    kind = rnd.choice(["replay", "stale", "other-run", "other-tenant", "far-seq", "start"])
    if kind == "replay":  # a duplicate of an already-valid seq, e.g. a retried send
        return _event(ref.seq, ref.epoch, run_id=ref.run_id)
    if kind == "stale":  # a fenced writer's next event, one epoch behind the newest owner
        return _event(ref.seq + 1, 0)
    if kind == "other-run":
        return _event(ref.seq + 1, ref.epoch, run_id="r-other")
    if kind == "other-tenant":
        return _event(ref.seq + 1, ref.epoch, tenant="evil")
    if kind == "far-seq":
        return _event(len(valid) + 5 + rnd.randrange(100), top)
    return _event(1, top + 1, EventType.RUN_STARTED)


@FAST
@given(histories, st.randoms(use_true_random=False), st.integers(min_value=1, max_value=15))
def test_invalid_events_anywhere_are_excluded_and_counted(
    h: tuple[int, list[int]], rnd: random.Random, count: int
) -> None:
    valid = _history(h[0], h[1])
    hostile = [_hostile(valid, rnd) for _ in range(count)]
    # Keep the valid history in order; put hostile events at random places after seq 1.
    mixed = list(valid)
    for ev in hostile:
        mixed.insert(rnd.randrange(1, len(mixed) + 1), ev)
    clean = fold(valid)
    dirty = fold(mixed)
    assert _stripped(dirty) == _stripped(clean)
    assert dirty.fenced_writes == count
    assert dirty.max_epoch_seen >= clean.max_epoch_seen


def test_unknown_event_type_raises_a_schema_error_not_a_crash() -> None:
    ev = _event(2, 1).model_copy(update={"type": "no_such_type"})
    st_ = fold([_event(1, 1, EventType.RUN_STARTED)])
    with pytest.raises(UnknownEventType):
        apply(st_, ev)
    assert issubclass(UnknownEventType, SchemaError)
    assert is_valid(st_, _event(2, 1))


# ---------------------------------------------------------------------------- tool arguments


class _Odd:
    pass


def _deep(n: int) -> Any:
    return [_deep(n - 1)] if n else 0


BAD_ARGS: list[tuple[str, Any]] = [
    ("set", {"ids": {1, 2}}),
    ("frozenset", {"ids": frozenset()}),
    ("nan", {"amount": math.nan}),
    ("inf", {"amount": math.inf}),
    ("object", {"who": _Odd()}),
    ("bytes", {"raw": b"\x00"}),
    ("int key", {1: "x"}),
    ("nested int key", {"a": [{"b": {2: "y"}}]}),
    ("tuple key", {(1, 2): "x"}),
    ("mixed keys", {1: "x", "b": 2}),
    ("lone surrogate", {"text": "\ud800"}),
    ("too large", {"blob": "x" * (MAX_ARGS_BYTES + 1)}),
    ("too deep", {"a": _deep(150)}),
]


@pytest.mark.parametrize(("why", "args"), BAD_ARGS, ids=[w for w, _ in BAD_ARGS])
def test_non_canonical_arguments_are_refused(why: str, args: Any) -> None:
    with pytest.raises(ToolArgumentsError):
        canonical_json(args)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


@FAST
@given(st.dictionaries(st.text(), json_values, max_size=6))
def test_canonical_json_is_order_independent_or_refused(args: dict[str, Any]) -> None:
    try:
        text = canonical_json(args)
    except ToolArgumentsError:
        return  # e.g. a lone surrogate drawn by st.text()
    assert canonical_json(dict(reversed(list(args.items())))) == text


@pytest.fixture
def services(test_settings: Settings) -> Iterator[Services]:
    svc = Services(test_settings, writer_id="hostile")
    yield svc
    svc.close()


def test_bad_tool_arguments_are_refused_before_started(
    test_settings: Settings, services: Services
) -> None:
    calls: list[str] = []

    def echo(args: dict[str, Any], *, idempotency_key: str) -> str:
        calls.append(idempotency_key)
        return "ok"

    tool = Tool(name="echo", fn=echo)
    rid = new_run_id()
    with open_run_with(services.run_deps(), rid, tools=[tool]) as run:
        for _why, args in BAD_ARGS:
            with pytest.raises(ToolArgumentsError):
                run.call_tool("echo", args)
            with pytest.raises(ToolArgumentsError):
                run.key_for("echo", args)
        assert run.call_tool("echo", {"fine": [1, 2]}) == "ok"
    with LogReader(test_settings) as reader:
        types = [r.event.type for r in reader.read(rid)]
    assert types.count(EventType.TOOL_CALL_STARTED) == 1, types
    assert len(calls) == 1
