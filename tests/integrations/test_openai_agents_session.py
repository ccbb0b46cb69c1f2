"""An OpenAI Agents SDK ``Session`` backed by the run's log (``RunlogSession``).

The history is MEMORY_WRITTEN events: a resumed run sees the items the crashed one recorded,
a re-executed agent loop is answered from the recorded operations instead of appending them
again, and ``pop_item``/``clear_session`` are operations of their own in the log.
"""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path
from typing import Any

import pytest
import redis
from test_openai_agents import (
    STEPS,
    assert_effects_once,
    assert_no_recorded_turn_requested_again,
    events_of,
    new_run_id,
    start,
)
from workers.common import EXIT_OK, KEEP, assert_log_sound, payloads

from runlog import aio
from runlog._settings import Settings
from runlog.integrations._openai_agents_session import (
    SESSION_KEY_PREFIX,
    RunlogSession,
    _Ops,
    recorded_ops,
)
from runlog.schemas._models import MemoryWritten
from runlog.schemas._vocabulary import EventType


def session_items(events: list[Any], session_id: str) -> list[dict[str, Any]]:
    ops = recorded_ops(events, session_id)
    return _Ops(ops, len(ops)).items()


@pytest.mark.timeout(600)
def test_a_session_agent_killed_at_every_tool_call_records_each_item_once(
    fast: Settings, ledger: Any, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """Each resumed worker runs the SDK's loop again from the top with the session: the
    prompt and the items of every recorded turn come back from the log, not appended again,
    so the session holds the conversation once and the model sees it once."""
    run_id = new_run_id()
    pace = ("--steps", str(STEPS), "--tool-s", "0.4", "--takeover", "--session")
    for k in range(STEPS):
        w = start(fast, tmp_path, f"w{k}", run_id, *pace)
        w.wait_flag(f"charged-{k}", timeout=90)
        w.kill(signal.SIGKILL)
    code, result = start(fast, tmp_path, "last", run_id, *pace, **KEEP).finish(timeout=120)
    assert code == EXIT_OK, result
    assert result["output"].startswith("done")

    events = events_of(fast, run_id)
    state = assert_log_sound(events)
    assert state.status == "finished" and state.turns == STEPS + 1
    assert_no_recorded_turn_requested_again(redis_client, fast, run_id, events)
    assert len(assert_effects_once(ledger, events, "charge")) == STEPS

    items = session_items(events, run_id)
    users = [i for i in items if i.get("role") == "user"]
    calls = [i["call_id"] for i in items if i.get("type") == "function_call"]
    outputs = [i["call_id"] for i in items if i.get("type") == "function_call_output"]
    assistant = [i for i in items if i.get("type") == "message" and i.get("role") == "assistant"]
    assert len(users) == 1
    assert calls == outputs == [f"pay-{t}" for t in range(STEPS)]
    assert len(assistant) == STEPS + 1

    # The finished run once more: the whole loop is answered from the log; nothing appended.
    code, again = start(fast, tmp_path, "again", run_id, *pace, **KEEP).finish(timeout=120)
    assert code == EXIT_OK, again
    assert again["requested"] == 0
    after = events_of(fast, run_id)
    assert len(recorded_ops(after, run_id)) == len(recorded_ops(events, run_id))


def test_a_session_on_an_open_run_is_its_log_and_pop_and_clear_are_recorded(
    fast: Settings,
) -> None:
    from agents import Agent, Runner, set_tracing_disabled
    from agents.testing import ScriptedModel, assistant_message

    set_tracing_disabled(True)
    run_id = new_run_id()
    model = ScriptedModel([[assistant_message("hello Ann")], [assistant_message("you are Ann")]])
    agent = Agent(name="chat", instructions="Chat.", model=model)

    async def first() -> None:
        async with aio.open_run(run_id, settings=fast) as run:
            session = await RunlogSession.open(run)
            await Runner.run(agent, "I am Ann", session=session)
            await Runner.run(agent, "who am I?", session=session)

    asyncio.run(first())
    second_input = model.calls[1].input
    assert [i.get("content") for i in second_input if i.get("role") == "user"] == [
        "I am Ann",
        "who am I?",
    ], "the second turn sees the history the first recorded"

    async def resumed() -> tuple[list[Any], Any, list[Any], list[Any]]:
        async with aio.open_run(run_id, settings=fast) as run:
            session = await RunlogSession.open(run)
            seen = await session.get_items()
            popped = await session.pop_item()
            after_pop = await session.get_items()
            await session.clear_session()
            return seen, popped, after_pop, await session.get_items()

    seen, popped, after_pop, cleared = asyncio.run(resumed())
    assert [i.get("content") for i in seen if i.get("role") == "user"] == ["I am Ann", "who am I?"]
    assert len(seen) == 4
    assert popped == seen[-1] and after_pop == seen[:-1] and cleared == []

    async def reopened() -> list[Any]:
        async with aio.open_run(run_id, settings=fast) as run:
            return await (await RunlogSession.open(run)).get_items()

    assert asyncio.run(reopened()) == []  # the clear is in the log, read back on open

    events = events_of(fast, run_id)
    ops = [
        json.loads(p.value)["op"]
        for p in payloads(events, EventType.MEMORY_WRITTEN)
        if isinstance(p, MemoryWritten) and p.key == SESSION_KEY_PREFIX + run_id
    ]
    assert ops == ["add", "add", "add", "add", "pop", "clear"]  # recorded, nothing rewritten


def test_a_session_agent_stopped_for_approval_resumes_with_the_conversation_once(
    fast: Settings, ledger: Any, tmp_path: Path
) -> None:
    """A ``needs_approval`` stop and its resumption: the SDK saves the turn before the
    interruption, the resumed execution replays those saves and the approved call's output
    is added once."""
    from workers.common import EXIT_ESCALATED

    run_id = new_run_id()
    args = ("--scenario", "approval", "--session")
    code, first = start(fast, tmp_path, "ask", run_id, *args, **KEEP).finish(120)
    assert code == EXIT_ESCALATED, first
    before = session_items(events_of(fast, run_id), run_id)
    assert before, "the turn before the interruption was saved"
    asyncio.run(
        aio.decide(run_id, first["approval_id"], approved=True, decided_by="ops", settings=fast)
    )
    code, done = start(fast, tmp_path, "after", run_id, *args, **KEEP).finish(120)
    assert code == EXIT_OK, done
    events = events_of(fast, run_id)
    assert assert_log_sound(events).status == "finished"
    assert len(assert_effects_once(ledger, events, "refund")) == 1
    items = session_items(events, run_id)
    assert items[: len(before)] == before  # what the stopped run saved stays as it was
    assert [i.get("role") for i in items if i.get("role") == "user"] == ["user"]
    assert [i["call_id"] for i in items if i.get("type") == "function_call"] == ["refund-0"]
    assert [i["call_id"] for i in items if i.get("type") == "function_call_output"] == ["refund-0"]


def test_a_replayed_execution_asking_for_other_items_is_refused_not_appended(
    fast: Settings,
) -> None:
    """Replay answers the n-th operation from the log only if it is the recorded one: an
    agent that now adds something else is told so, and the log keeps what it had."""
    from runlog.integrations._openai_agents_session import SessionDiverged

    run_id = new_run_id()

    async def go() -> None:
        async with aio.open_run(run_id, settings=fast) as run:
            live = await RunlogSession.open(run)
            await live.add_items([{"role": "user", "content": "refund order 42"}])
            await run.barrier()
            replay = RunlogSession(
                run, recorded=recorded_ops(events_of(fast, run_id), run_id), replay=True
            )
            assert replay.replaying and await replay.get_items() == []
            await replay.add_items([{"role": "user", "content": "refund order 42"}])
            assert not replay.replaying  # the recorded operation, not appended again
            again = RunlogSession(
                run, recorded=recorded_ops(events_of(fast, run_id), run_id), replay=True
            )
            with pytest.raises(SessionDiverged):
                await again.add_items([{"role": "user", "content": "refund order 43"}])

    asyncio.run(go())
    assert session_items(events_of(fast, run_id), run_id) == [
        {"role": "user", "content": "refund order 42"}
    ]
