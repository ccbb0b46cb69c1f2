"""Idempotency keys: one key per action, unambiguous, and stable for runs begun under an
older key scheme (a released scheme is part of the log's contract, like a schema)."""

from __future__ import annotations

from typing import Any

import pytest
import redis
from confluent_kafka import Producer
from replay_support import FIXTURE_VERSIONS, Fixture, FixtureRecord, load_fixture
from workers.common import services_for

import runlog
from runlog._settings import Settings
from runlog.projections._run_state import RunState, apply
from runlog.schemas._canonical import canonical_json
from runlog.schemas._keys import KEY_SCHEME, idempotency_key, key_scheme_of

pytestmark = pytest.mark.timeout(60)


def test_fields_that_join_alike_make_different_keys() -> None:
    """Scheme 1 joined the fields with an unescaped separator: a scope holding it could
    produce the key of another scope's call of another tool."""
    args = canonical_json({"amount": 7})
    one = ("acme", "order-1\x1fpay", "refund", args, 0)
    two = ("acme", "order-1", "pay\x1frefund", args, 0)
    assert idempotency_key(*one, scheme=1) == idempotency_key(*two, scheme=1)  # the flaw
    assert idempotency_key(*one) != idempotency_key(*two)
    # Arguments and ordinal cannot be confused either.
    assert idempotency_key("t", "s", "x", '{"a":1}', 10) != idempotency_key(
        "t", "s", "x", '{"a":1}1', 0
    )


def test_new_keys_are_of_the_current_scheme_and_old_keys_keep_theirs() -> None:
    new = idempotency_key("t", "run", "pay", "{}", 0)
    old = idempotency_key("t", "run", "pay", "{}", 0, scheme=1)
    assert KEY_SCHEME == 2 and new.startswith("k2_") and len(new) == 35
    assert len(old) == 32 and int(old, 16) >= 0  # the released format, unchanged
    assert key_scheme_of([]) == 2 and key_scheme_of([new]) == 2
    assert key_scheme_of([old]) == 1 and key_scheme_of([new, old]) == 1


def _produce(settings: Settings, records: list[FixtureRecord]) -> None:
    p = Producer({**settings.kafka_common(), "partitioner": "murmur2_random", "acks": "all"})
    for r in records:
        p.produce(settings.events_topic, key=r.key, value=r.value, headers=list(r.headers))
    assert p.flush(30) == 0


def _before_finish(fx: Fixture) -> tuple[list[FixtureRecord], RunState]:
    state, out = RunState(), []
    for r, ev in zip(fx.records, fx.events(), strict=True):
        if ev.type is runlog.EventType.RUN_FINISHED:
            break
        out.append(r)
        apply(state, ev)
    return out, state


@pytest.mark.parametrize("version", FIXTURE_VERSIONS)
def test_an_old_run_resumes_computing_the_keys_it_already_recorded(
    version: str, test_settings: Settings, redis_client: redis.Redis
) -> None:
    """Re-executing the fixture's first calls from the top reaches the keys the log holds
    (scheme 1 for the fixtures written before scheme 2, scheme 2 after): the stored
    results come back and no tool runs."""
    fx = load_fixture(version)
    records, state = _before_finish(fx)
    scheme = key_scheme_of(state.completed_calls)
    assert scheme == (1 if version in ("v1", "v2") else KEY_SCHEME)
    _produce(test_settings, records)
    invoked: list[str] = []

    def tool(name: str) -> Any:
        @runlog.tool(name)
        def fn(args: dict[str, Any], *, idempotency_key: str) -> str:
            invoked.append(idempotency_key)
            return "ran again"

        return fn

    tools = [tool(n) for n in ("lookup", "notify")]
    with runlog.open_run(fx.run_id, tenant=fx.tenant, settings=test_settings, tools=tools) as run:
        assert run.key_scheme == scheme
        if state.cancel is not None:
            # From v5 a person cancelled the fixture's run before its finish: the agent is
            # told at its first step, once; its steps (clean-up) run on after that.
            with pytest.raises(runlog.Cancelled):
                run.check_cancelled()
        old = idempotency_key(fx.tenant, fx.run_id, "lookup", '{"q":"order 42"}', 0, scheme=scheme)
        assert old in state.completed_calls
        assert run.key_for("lookup", {"q": "order 42"}) == old
        assert run.call_tool("lookup", {"q": "order 42"}) == state.completed_calls[old]
        # The call its first owner crashed in was recovered under its old key too.
        notify = idempotency_key(
            fx.tenant, fx.run_id, "notify", '{"to":"customer"}', 0, scheme=scheme
        )
        assert notify in run.state.completed_calls
        assert run.call_tool("notify", {"to": "customer"}) == run.state.completed_calls[notify]
    assert invoked == []


def test_a_new_run_records_keys_of_the_current_scheme(test_settings: Settings) -> None:
    with services_for(test_settings):

        @runlog.tool("echo")
        def echo(args: dict[str, Any], *, idempotency_key: str) -> str:
            return idempotency_key

        with runlog.open_run(settings=test_settings, tools=[echo]) as run:
            key = run.call_tool("echo", {"x": 1})
            assert key.startswith("k2_") and run.key_scheme == 2
            assert key == idempotency_key(run.tenant, run.run_id, "echo", '{"x":1}', 0)
