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
from workers.common import EXIT_OK, ROOT, Worker, assert_log_sound, payloads, read_log, worker_env
from workers.pai_worker import requests_key

from runlog.schemas.models import Event, ModelTurn, ToolCallStarted
from runlog.schemas.vocabulary import EventType
from runlog.settings import Settings

PAI_WORKER = Path(__file__).resolve().parents[1] / "workers" / "pai_worker.py"
STEPS = 5


def start(settings: Settings, tmp: Path, name: str, run_id: str, *args: str) -> Worker:
    cmd = [sys.executable, str(PAI_WORKER), "--dir", str(tmp), "--name", name, "--capability"]
    proc = subprocess.Popen(
        [*cmd, "--run-id", run_id, *args],
        env=worker_env(settings),
        cwd=str(ROOT),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return Worker(proc, tmp, name)


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
    code, result = start(fast, tmp_path, "last", run_id, *pace).finish(timeout=120)
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

    code, again = start(fast, tmp_path, "again", run_id, *pace).finish(timeout=120)
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
