"""Values a reader must refuse or set aside, never crash on or fold.

* A NaN or infinite float (a model's ``cost_usd``) is refused by the payload model: the
  writer never appends it, and a record holding one (from an older writer, or another
  producer) is quarantined by the projections. NaN != NaN, so folding one made two folds
  of the same log compare unequal.
* An upcaster that raises turns into ``UpcastFailed`` (a ``SchemaError`` naming the type
  and the versions), so readers quarantine the record instead of dying on it.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import redis
from codec_support import encode_unchecked, make_event
from confluent_kafka import Producer
from pydantic import ValidationError
from replay_support import load_fixture

from runlog._bootstrap import Services
from runlog._settings import Settings
from runlog.consumers import _queries as queries
from runlog.consumers.runner import ProjectionRunner
from runlog.errors import SchemaError, UpcastFailed, ValidationFailed
from runlog.log._reader import LogReader
from runlog.producers._opening import open_run_with
from runlog.schemas import _codec as codec
from runlog.schemas import _evolution as evolution
from runlog.schemas._models import Event, ModelTurn
from runlog.schemas._vocabulary import EventType

CC = EventType.CONTEXT_COMPACTED


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_costs_are_refused_by_the_model(bad: float) -> None:
    with pytest.raises(ValidationError):
        ModelTurn(cost_usd=bad)
    with pytest.raises(ValidationFailed, match="cost_usd"):
        codec.make_payload(EventType.MODEL_TURN, {"cost_usd": bad})
    assert ModelTurn(cost_usd=0.25).cost_usd == 0.25


def test_the_writer_never_appends_a_nan_cost(test_settings: Settings) -> None:
    services = Services(test_settings, writer_id="nan")
    try:
        with open_run_with(services.run_deps()) as run:
            with pytest.raises(ValidationFailed, match="cost_usd"):
                run.append(EventType.MODEL_TURN, text="t", cost_usd=float("nan"))
            run.append(EventType.MODEL_TURN, text="t", cost_usd=0.5)
            run.finish("done")
            rid = run.run_id
    finally:
        services.close()
    with LogReader(test_settings) as reader:
        turns = [r.event for r in reader.read(rid) if r.event.type is EventType.MODEL_TURN]
    assert [t.payload.cost_usd for t in turns] == [0.5]  # type: ignore[attr-defined]


def _event(run_id: str, seq: int, et: EventType, **payload: Any) -> Event:
    return make_event(et, payload, run_id=run_id, seq=seq, event_id=f"{run_id}-{seq}")


def _produce(settings: Settings, records: list[tuple[str, bytes]]) -> None:
    producer = Producer({**settings.kafka_common(), "partitioner": "murmur2_random"})
    for key, value in records:
        producer.produce(settings.events_topic, key=key.encode(), value=value)
    assert producer.flush(30) == 0


def test_a_logged_nan_cost_is_quarantined_not_folded(
    test_settings: Settings, redis_client: redis.Redis
) -> None:
    turn = _event("nan-run", 2, EventType.MODEL_TURN, text="t", cost_usd=0.1)
    nan_record = encode_unchecked(turn, payload={"cost_usd": float("nan")})
    with pytest.raises(ValidationFailed, match="cost_usd"):
        codec.decode(nan_record)
    _produce(
        test_settings,
        [
            ("nan-run", codec.encode(_event("nan-run", 1, EventType.RUN_STARTED))),
            ("nan-run", nan_record),
        ],
    )
    ProjectionRunner(test_settings, redis_client, ("state",)).catch_up(timeout_s=60)
    recs = queries.quarantined(redis_client, test_settings, ("state",))
    assert [(r["run_id"], r["error"]) for r in recs] == [("nan-run", "ValidationFailed")]
    view = queries.get_state(redis_client, test_settings, "nan-run")
    assert view is not None and view["state"]["cost_usd"] == 0.0


def _v1_compaction() -> bytes:
    fx = load_fixture("v1")
    return next(r.value for r in fx.records if r.type == CC.value)


def _broken_upcaster(payload: dict[str, Any]) -> dict[str, Any]:
    raise KeyError("kept")


def test_an_upcaster_that_raises_is_a_schema_error_naming_the_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(evolution.UPCASTERS, (CC, 1), _broken_upcaster)
    with pytest.raises(UpcastFailed) as err:
        codec.decode(_v1_compaction())
    assert isinstance(err.value, SchemaError)
    assert "context_compacted" in str(err.value) and "v1 -> v2" in str(err.value)
    assert "KeyError" in str(err.value)


def test_a_record_whose_upcaster_raises_is_quarantined_and_the_runner_goes_on(
    test_settings: Settings, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = _v1_compaction()
    rid = codec.decode(old).run_id
    _produce(
        test_settings,
        [
            (rid, old),
            ("after-it", codec.encode(_event("after-it", 1, EventType.RUN_STARTED))),
        ],
    )
    monkeypatch.setitem(evolution.UPCASTERS, (CC, 1), _broken_upcaster)
    runner = ProjectionRunner(test_settings, redis_client, ("state", "audit"))
    runner.catch_up(timeout_s=60)
    recs = queries.quarantined(redis_client, test_settings)
    assert [(r["run_id"], r["error"]) for r in recs] == [(rid, "UpcastFailed")]
    assert "v1 -> v2" in recs[0]["message"]
    assert queries.get_state(redis_client, test_settings, "after-it") is not None
