"""An OpenAI Agents SDK agent as a runlog run: real worker processes killed and resumed.

Offline: the model is a scripted ``agents`` ``Model`` in ``workers/oai_worker.py``. Effects
go to a receiver in Redis that does not deduplicate (every apply counts, by key); every
answer the model gave is logged there too, with a nonce the response carries into the log.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
from workers.common import (
    EXIT_ESCALATED,
    EXIT_OK,
    KEEP,
    ROOT,
    Worker,
    assert_log_sound,
    payloads,
    read_log,
    start_worker,
    worker_env,
)
from workers.oai_worker import requests_key

from runlog import aio
from runlog._settings import Settings
from runlog.schemas._models import Event, ModelTurn, ToolCallStarted
from runlog.schemas._vocabulary import EventType

OAI_WORKER = Path(__file__).resolve().parents[1] / "workers" / "oai_worker.py"
STEPS = 6


def start(settings: Settings, tmp: Path, name: str, run_id: str, *args: str, **env: str) -> Worker:
    return start_worker(settings, tmp, name, "--run-id", run_id, *args, script=OAI_WORKER, **env)


def new_run_id() -> str:
    return f"oai-{uuid.uuid4().hex[:16]}"


def events_of(settings: Settings, run_id: str) -> list[Event]:
    return [rec.event for rec in read_log(settings, run_id)]


def assert_no_recorded_turn_requested_again(
    client: redis.Redis, settings: Settings, run_id: str, events: list[Event]
) -> None:
    """Turn t's MODEL_TURN carries the nonce of the answer it recorded: it must be the
    last answer the model ever gave for t (a request after the record would come later)."""
    turns = payloads(events, EventType.MODEL_TURN)
    assert turns, "no model turn recorded"
    for t, turn in enumerate(turns):
        assert isinstance(turn, ModelTurn)
        assert turn.response_json, "the whole response is recorded"
        asked = [
            n.decode()
            for n in client.lrange(requests_key(settings.redis_key_prefix, run_id, t), 0, -1)
        ]
        assert asked, f"turn {t} recorded but never requested"
        assert turn.text.endswith(asked[-1]), f"turn {t} requested again after it was recorded"
    assert not client.exists(requests_key(settings.redis_key_prefix, run_id, len(turns)))


def assert_effects_once(ledger: Any, events: list[Event], tool: str) -> list[str]:
    started = [p for p in payloads(events, EventType.TOOL_CALL_STARTED) if p.name == tool]
    keys = sorted({p.idempotency_key for p in started if isinstance(p, ToolCallStarted)})
    counts = ledger.per_key()
    assert sorted(counts) == keys, f"effects {counts} vs started keys {keys}"
    assert all(n == 1 for n in counts.values()), f"an effect happened twice: {counts}"
    return keys


@pytest.mark.timeout(600)
def test_an_agent_killed_at_every_tool_call_resumes_with_every_effect_once(
    fast: Settings, ledger: Any, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """Worker k is SIGKILLed inside charge k: before the receiver saw it (odd k: recovery
    finds it absent and retries it under its key) or after (even k: recovery finds it by
    its key). The worker after the last kill finishes the run."""
    run_id = new_run_id()
    pace = ("--steps", str(STEPS), "--pre-s", "0.4", "--tool-s", "0.4", "--takeover")
    for k in range(STEPS):
        w = start(fast, tmp_path, f"w{k}", run_id, *pace)
        w.wait_flag(f"charged-{k}" if k % 2 == 0 else f"in-{k}", timeout=90)
        w.kill(signal.SIGKILL)
    last = start(fast, tmp_path, "last", run_id, *pace, **KEEP)
    code, result = last.finish(timeout=120)
    assert code == EXIT_OK, result
    assert result["output"].startswith("done")

    events = events_of(fast, run_id)
    state = assert_log_sound(events)
    assert state.status == "finished" and state.outcome == "succeeded"
    assert state.turns == STEPS + 1
    assert state.resumptions >= STEPS
    assert_no_recorded_turn_requested_again(redis_client, fast, run_id, events)
    keys = assert_effects_once(ledger, events, "charge")
    assert len(keys) == STEPS  # one charge per step: none twice, none lost
    announced = {
        c.idempotency_key
        for p in payloads(events, EventType.MODEL_TURN)
        for c in p.tool_calls
        if c.name == "charge"
    }
    assert announced == set(keys)  # the keys each turn announced are the keys that ran

    # Run again on the finished run: the whole run replays, nothing requested, nothing run.
    code, again = start(fast, tmp_path, "again", run_id, *pace, **KEEP).finish(timeout=120)
    assert code == EXIT_OK, again
    assert again["requested"] == 0 and again["replayed"] == STEPS + 1
    assert again["output"] == result["output"]
    assert_effects_once(ledger, events_of(fast, run_id), "charge")


def test_a_tool_needing_approval_waits_for_a_runlog_decision_then_runs_once(
    fast: Settings, ledger: Any, tmp_path: Path
) -> None:
    run_id = new_run_id()
    code, first = start(fast, tmp_path, "a", run_id, "--scenario", "approval", **KEEP).finish(120)
    assert code == EXIT_ESCALATED, first
    assert ledger.per_key() == {}  # nothing ran before a person decided
    asyncio.run(
        aio.decide(run_id, first["approval_id"], approved=True, decided_by="ops", settings=fast)
    )
    code, done = start(fast, tmp_path, "b", run_id, "--scenario", "approval", **KEEP).finish(120)
    assert code == EXIT_OK, done
    events = events_of(fast, run_id)
    state = assert_log_sound(events)
    assert state.status == "finished"
    (key,) = assert_effects_once(ledger, events, "refund")
    (approval,) = state.approvals.values()
    assert approval.idempotency_key == key and approval.approved


def test_a_rejected_approval_reaches_the_agent_and_nothing_runs(
    fast: Settings, ledger: Any, tmp_path: Path
) -> None:
    run_id = new_run_id()
    code, first = start(fast, tmp_path, "a", run_id, "--scenario", "approval", **KEEP).finish(120)
    assert code == EXIT_ESCALATED, first
    asyncio.run(
        aio.decide(
            run_id,
            first["approval_id"],
            approved=False,
            decided_by="ops",
            note="not this one",
            settings=fast,
        )
    )
    code, done = start(fast, tmp_path, "b", run_id, "--scenario", "approval", **KEEP).finish(120)
    assert code == EXIT_OK, done
    state = assert_log_sound(events_of(fast, run_id))
    assert state.status == "finished"
    assert ledger.per_key() == {}
    assert json.dumps(done)  # the agent finished after being told no


def _streamed_agent(model: Any, calls: list[str]) -> Any:
    from agents import Agent, function_tool

    import runlog

    @function_tool
    def ship(order: int) -> str:
        """Ship an order."""
        ctx = runlog.current_call()
        assert ctx is not None
        calls.append(ctx.idempotency_key)
        return f"shipped {order}"

    return Agent(name="shipper", instructions="Ship.", model=model, tools=[ship])


def test_streamed_events_pass_through_and_a_replay_streams_without_asking_the_model(
    fast: Settings,
) -> None:
    from agents import set_tracing_disabled
    from agents.testing import ScriptedModel, assistant_message, function_call

    from runlog.integrations.openai_agents import RunlogAgents, ToolPolicy

    set_tracing_disabled(True)
    calls: list[str] = []
    live = ScriptedModel(
        [[function_call("ship", {"order": 7}, call_id="s1")], [assistant_message("all shipped")]]
    )
    seen: list[Any] = []
    durable = RunlogAgents(
        _streamed_agent(live, calls), tools={"ship": ToolPolicy("reversible")}, settings=fast
    )
    got = asyncio.run(durable.run("ship order 7", on_event=seen.append))
    assert got.output == "all shipped" and got.requested_turns == 2
    kinds = {getattr(e, "type", "") for e in seen}
    assert {"raw_response_event", "run_item_stream_event"} <= kinds
    deltas = [e for e in seen if getattr(getattr(e, "data", None), "type", "").endswith(".delta")]
    assert deltas, "the model's own stream events reach the caller"
    assert len(calls) == 1

    # The same run again, on a model with no steps left: every turn comes from the log.
    again: list[Any] = []
    replay = RunlogAgents(
        _streamed_agent(ScriptedModel([]), calls),
        tools={"ship": ToolPolicy("reversible")},
        settings=fast,
    )
    got2 = asyncio.run(replay.run(run_id=got.run_id, on_event=again.append))
    assert got2.output == "all shipped"
    assert (got2.requested_turns, got2.replayed_turns) == (0, 2)
    assert len(calls) == 1  # the recorded call answered from the log
    assert any(getattr(e, "type", "") == "run_item_stream_event" for e in again)


def test_a_worker_fenced_inside_a_tool_call_stops_with_runlogs_fenced_error(
    fast: Settings, ledger: Any, tmp_path: Path
) -> None:
    """The SDK wraps what a tool raises in its own error; runlog's errors (here ``Fenced``:
    another worker took the run over while this one was in the tool) reach the caller as
    themselves, so a worker can tell a takeover from a failure."""
    from workers.common import EXIT_FENCED

    run_id = new_run_id()
    old = start(fast, tmp_path, "old", run_id, "--scenario", "held")
    old.wait_flag("in_tool", timeout=90)
    # The new owner holds a longer lease and session than `fast`: a stall of the shared CI
    # machine past 1.5 s fenced it once, which is right but not this test's point.
    new = start(fast, tmp_path, "new", run_id, "--scenario", "held", "--takeover", **KEEP)
    code, taken = new.finish(timeout=120)  # irreversible, no evidence: a person must decide
    assert code == EXIT_ESCALATED, taken
    old.go()
    code, result = old.finish(timeout=60)
    assert code == EXIT_FENCED, result
    assert list(ledger.per_key().values()) == [1]


@pytest.mark.timeout(300)
def test_a_worker_killed_while_waiting_for_approval_resumes_with_the_decision_and_runs_once(
    fast: Settings, ledger: Any, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """The SDK's ``needs_approval`` interruption as a runlog approval, across a SIGKILL: the
    worker waiting for the decision dies, a person approves with ``runlog approve``, and the
    next worker replays to the same call (the model not asked again), finds the decision by
    the call's key and runs the refund once."""
    import time

    run_id = new_run_id()
    waiting = start(
        fast, tmp_path, "waiting", run_id, "--scenario", "approval", "--approval-wait-s", "120"
    )
    deadline = time.monotonic() + 90
    while not payloads(events_of(fast, run_id), EventType.APPROVAL_REQUESTED):
        assert time.monotonic() < deadline, "no approval was requested"
        time.sleep(0.2)
    waiting.kill(signal.SIGKILL)
    (requested,) = payloads(events_of(fast, run_id), EventType.APPROVAL_REQUESTED)
    assert ledger.per_key() == {}

    cli = Path(sys.executable).with_name("runlog")
    done = subprocess.run(
        [str(cli), "approve", run_id, requested.approval_id, "--by", "alice"],
        env=worker_env(fast),
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr

    code, after = start(
        fast, tmp_path, "after", run_id, "--scenario", "approval", "--takeover", **KEEP
    ).finish(timeout=120)
    assert code == EXIT_OK, after
    events = events_of(fast, run_id)
    state = assert_log_sound(events)
    assert state.status == "finished"
    (key,) = assert_effects_once(ledger, events, "refund")
    (approval,) = state.approvals.values()
    assert approval.approved and approval.decided_by == "alice"
    assert approval.idempotency_key == key
    assert_no_recorded_turn_requested_again(redis_client, fast, run_id, events)


def test_a_caller_killed_in_the_first_model_call_resumes_the_run_by_the_handles_id(
    fast: Settings, ledger: Any, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """``RunlogAgents.start`` gives the run's id before the model is first asked: the worker
    keeps it, is SIGKILLed inside that first request, and a new worker resumes the run by
    the kept id to its end, each charge once, the prompt recorded once."""
    first = start(fast, tmp_path, "first", "new", "--steps", "2", "--think-s", "30")
    run_id = first.wait_flag("run_id", timeout=90)
    assert first.wait_flag("live", timeout=90) == "model 0"  # inside the first request
    first.kill(signal.SIGKILL)
    assert not payloads(events_of(fast, run_id), EventType.MODEL_TURN)

    again = start(fast, tmp_path, "again", run_id, "--steps", "2", "--takeover", **KEEP)
    code, done = again.finish(120)
    assert code == EXIT_OK, done
    events = events_of(fast, run_id)
    state = assert_log_sound(events)
    assert state.status == "finished" and state.outcome == "succeeded"
    assert len(payloads(events, EventType.USER_MESSAGE)) == 1
    assert len(assert_effects_once(ledger, events, "charge")) == 2


def test_on_open_gets_the_run_id_before_the_model_is_asked(fast: Settings) -> None:
    from agents import set_tracing_disabled
    from agents.testing import ScriptedModel, assistant_message

    from runlog.integrations.openai_agents import RunlogAgents

    set_tracing_disabled(True)
    seen: list[str] = []

    class Watched(ScriptedModel):
        async def get_response(self, *a: Any, **kw: Any) -> Any:
            seen.append("model")
            return await super().get_response(*a, **kw)

    agent = _streamed_agent(Watched([[assistant_message("hello")]]), [])
    opened: list[str] = []

    async def on_open(run_id: str) -> None:  # an async callback is awaited
        seen.append("opened")
        opened.append(run_id)

    got = asyncio.run(RunlogAgents(agent, settings=fast).run("hi", on_open=on_open))
    assert seen == ["opened", "model"]
    assert opened == [got.run_id]


def test_start_refuses_a_bad_run_id_and_a_missing_event_loop_before_anything_runs() -> None:
    import gc
    import warnings

    from agents.testing import ScriptedModel

    from runlog.errors import InvalidRunId
    from runlog.integrations.openai_agents import RunlogAgents

    durable = RunlogAgents(_streamed_agent(ScriptedModel([]), []))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError):  # no running loop: no task, no coroutine left over
            durable.start("hi")
        gc.collect()
    assert not [w for w in caught if "never awaited" in str(w.message)]

    async def bad_id() -> None:
        durable.start("hi", run_id="two words")

    with pytest.raises(InvalidRunId):
        asyncio.run(bad_id())
