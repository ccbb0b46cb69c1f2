"""Runlog as a Pydantic AI capability (``RunlogDurability``): the agent stays a plain
``Agent``; its worker process is SIGKILLed inside every tool call and resumed.

Offline: the model is the scripted ``FunctionModel`` of ``workers/pai_worker.py`` (run with
``--capability``). Effects go to a receiver in Redis that does not deduplicate.
"""

from __future__ import annotations

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
from workers.pai_worker import requests_key

from runlog._settings import Settings
from runlog.schemas._models import Event, ModelTurn, ToolCallStarted
from runlog.schemas._vocabulary import EventType

PAI_WORKER = Path(__file__).resolve().parents[1] / "workers" / "pai_worker.py"
STEPS = 5


def start(settings: Settings, tmp: Path, name: str, run_id: str, *args: str, **env: str) -> Worker:
    return start_worker(
        settings, tmp, name, "--capability", "--run-id", run_id, *args, script=PAI_WORKER, **env
    )


def events_of(settings: Settings, run_id: str) -> list[Event]:
    return [rec.event for rec in read_log(settings, run_id)]


def assert_effects_once(ledger: Any, events: list[Event]) -> list[str]:
    started = [p for p in payloads(events, EventType.TOOL_CALL_STARTED) if p.name == "charge"]
    keys = sorted({p.idempotency_key for p in started if isinstance(p, ToolCallStarted)})
    counts = ledger.per_key()
    assert sorted(counts) == keys, f"effects {counts} vs started keys {keys}"
    assert all(n == 1 for n in counts.values()), f"an effect happened twice: {counts}"
    return keys


@pytest.mark.timeout(600)
def test_a_plain_agent_with_the_capability_killed_at_every_tool_call_repeats_no_effect(
    fast: Settings, ledger: Any, redis_client: redis.Redis, tmp_path: Path
) -> None:
    run_id = f"pcap-{uuid.uuid4().hex[:16]}"
    pace = ("--steps", str(STEPS), "--tool-s", "0.4", "--takeover")
    for k in range(STEPS):
        w = start(fast, tmp_path, f"w{k}", run_id, *pace)
        w.wait_flag(f"charged-{k}", timeout=90)  # the receiver applied it; not yet recorded
        w.kill(signal.SIGKILL)
    code, result = start(fast, tmp_path, "last", run_id, *pace, **KEEP).finish(timeout=120)
    assert code == EXIT_OK, result
    assert result["output"].startswith("done")

    events = events_of(fast, run_id)
    state = assert_log_sound(events)
    assert state.status == "finished" and state.outcome == "succeeded"
    assert state.turns == STEPS + 1 and state.resumptions >= STEPS
    keys = assert_effects_once(ledger, events)
    assert len(keys) == STEPS
    # No turn the log holds was asked of the model again: turn t's record carries the
    # nonce of the last answer the model gave for t.
    for t, turn in enumerate(payloads(events, EventType.MODEL_TURN)):
        assert isinstance(turn, ModelTurn)
        asked = redis_client.lrange(requests_key(fast.redis_key_prefix, run_id, t), 0, -1)
        assert asked and turn.text.endswith(asked[-1].decode()), f"turn {t} asked again"

    code, again = start(fast, tmp_path, "again", run_id, *pace, **KEEP).finish(timeout=120)
    assert code == EXIT_OK, again
    assert again["requested"] == 0 and again["replayed"] == STEPS + 1
    assert_effects_once(ledger, events_of(fast, run_id))


def test_run_sync_and_run_stream_of_the_plain_agent_are_recorded_and_replayed(
    fast: Settings,
) -> None:
    import asyncio

    from pydantic_ai import Agent
    from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
    from pydantic_ai.models.function import AgentInfo, FunctionModel

    import runlog
    from runlog.integrations.pydantic_ai_capability import RunlogDurability, ToolPolicy

    asked: list[int] = []
    shipped: list[str] = []

    def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        turn = sum(1 for m in messages if isinstance(m, ModelResponse))
        asked.append(turn)
        if turn == 0:
            return ModelResponse(parts=[ToolCallPart("ship", {"order": 7}, tool_call_id="s0")])
        return ModelResponse(parts=[TextPart("shipped order 7")])

    cap = RunlogDurability(tools={"ship": ToolPolicy("reversible")}, settings=fast)
    agent = Agent(FunctionModel(script), capabilities=[cap], name="shipper")

    @agent.tool_plain
    def ship(order: int) -> str:
        call = runlog.current_call()
        assert call is not None, "the tool runs through runlog's call path"
        shipped.append(call.idempotency_key)
        return f"shipped {order}"

    rid = f"pcap-{uuid.uuid4().hex[:12]}"
    assert agent.run_sync("ship order 7", run_id=rid).output == "shipped order 7"
    assert (asked, len(shipped)) == ([0, 1], 1)

    async def stream(run_id: str) -> str:
        async with agent.run_stream("ship order 7", run_id=run_id) as result:
            return await result.get_output()

    asked.clear()
    assert asyncio.run(stream(rid)) == "shipped order 7"  # the finished run, streamed from its log
    assert asked == [] and len(shipped) == 1
    assert (cap.replayed_turns, cap.requested_turns) == (2, 0)

    rid2 = f"pcap-{uuid.uuid4().hex[:12]}"
    assert asyncio.run(stream(rid2)) == "shipped order 7"  # a new run, streamed live
    assert asked == [0, 1] and len(shipped) == 2
    assert cap.last_run is not None and cap.last_run.run_id == rid2
    events = events_of(fast, rid2)
    assert len(payloads(events, EventType.MODEL_TURN)) == 2
    assert assert_log_sound(events).status == "finished"


def _approval_requested(settings: Settings, run_id: str) -> bool:
    return bool(payloads(events_of(settings, run_id), EventType.APPROVAL_REQUESTED))


@pytest.mark.timeout(300)
def test_a_tool_needing_approval_waits_for_runlog_approve_and_survives_kill_9_while_waiting(
    fast: Settings, ledger: Any, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """``requires_approval=True`` under the capability: the call becomes a runlog approval
    and the run waits for a person. The worker waiting for the decision is SIGKILLed; a
    person approves with ``runlog approve``; the next worker replays to the call, finds the
    decision by the call's key and runs the refund once."""
    import time

    run_id = f"pcap-{uuid.uuid4().hex[:16]}"
    first = start(fast, tmp_path, "ask", run_id, "--scenario", "approval", **KEEP)
    code, asked = first.finish(timeout=120)
    assert code == EXIT_ESCALATED, asked  # no one decided: the run waits for a person
    approval_id = asked["approval_id"]
    assert ledger.total() == 0
    (open_approval,) = assert_log_sound(events_of(fast, run_id)).approvals.values()
    assert open_approval.approved is None  # asked of a person, not decided

    waiting = start(
        fast, tmp_path, "waiting", run_id, "--scenario", "approval", "--approval-wait-s", "120"
    )
    deadline = time.monotonic() + 60
    while len(redis_client.lrange(requests_key(fast.redis_key_prefix, run_id, 0), 0, -1)) < 1:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    time.sleep(1.0)  # replayed to the call and polling for the decision
    waiting.kill(signal.SIGKILL)

    cli = Path(sys.executable).with_name("runlog")
    done = subprocess.run(
        [str(cli), "approve", run_id, approval_id, "--by", "alice", "--note", "ok"],
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
    assert after["output"].startswith("done") and after["requested"] == 1

    events = events_of(fast, run_id)
    state = assert_log_sound(events)
    assert state.status == "finished"
    (approval,) = state.approvals.values()
    assert approval.approved and approval.decided_by == "alice"
    started = [p for p in payloads(events, EventType.TOOL_CALL_STARTED) if p.name == "refund"]
    assert len(started) == 1 and isinstance(started[0], ToolCallStarted)
    assert approval.idempotency_key == started[0].idempotency_key
    assert ledger.per_key() == {started[0].idempotency_key: 1}
    assert len(redis_client.lrange(requests_key(fast.redis_key_prefix, run_id, 0), 0, -1)) == 1


def test_a_rejected_approval_reaches_a_plain_agent_as_a_denial_and_nothing_runs(
    fast: Settings,
) -> None:
    """The agent needs no ``DeferredToolRequests`` output type: the capability answers the
    held-back call itself, and a person's no is what the model is told."""
    import asyncio

    from pydantic_ai import Agent
    from pydantic_ai.messages import (
        ModelMessage,
        ModelRequest,
        ModelResponse,
        TextPart,
        ToolCallPart,
        ToolReturnPart,
    )
    from pydantic_ai.models.function import AgentInfo, FunctionModel

    import runlog
    from runlog import aio
    from runlog.integrations.pydantic_ai_capability import RunlogDurability

    told: list[str] = []
    refunded: list[str] = []

    def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if not any(isinstance(m, ModelResponse) for m in messages):
            return ModelResponse(parts=[ToolCallPart("refund", {"order": 42}, tool_call_id="r0")])
        last = messages[-1]
        assert isinstance(last, ModelRequest)
        told.extend(str(p.content) for p in last.parts if isinstance(p, ToolReturnPart))
        return ModelResponse(parts=[TextPart("refund not made")])

    cap = RunlogDurability(settings=fast)
    agent = Agent(FunctionModel(script), capabilities=[cap], name="refunder")

    @agent.tool_plain(requires_approval=True)
    def refund(order: int) -> str:
        call = runlog.current_call()
        assert call is not None
        refunded.append(call.idempotency_key)
        return f"refunded {order}"

    rid = f"pcap-{uuid.uuid4().hex[:12]}"
    with pytest.raises(runlog.Escalated) as waiting:
        agent.run_sync("refund order 42", run_id=rid)
    asyncio.run(
        aio.decide(
            rid,
            str(waiting.value.approval_id),
            approved=False,
            decided_by="bob",
            note="already credited",
            settings=fast,
        )
    )
    assert agent.run_sync("refund order 42", run_id=rid).output == "refund not made"
    assert refunded == [] and told == ["already credited"]
    state = assert_log_sound(events_of(fast, rid))
    assert state.status == "finished"
    assert not payloads(events_of(fast, rid), EventType.TOOL_CALL_STARTED)
