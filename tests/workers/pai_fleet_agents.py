"""A Pydantic AI agent registered with the fleet (`--agents workers.pai_fleet_agents`).

The model is Pydantic AI's own ``FunctionModel`` (no network): for a prompt ``"order O
steps N"`` it asks for ``charge`` N times, one call a turn, then answers. ``charge`` is
irreversible against a receiver that does not deduplicate: each call adds one to the count
of its idempotency key in Redis (``<prefix>:effects``) and keeps its result for the lookup
(``<prefix>:results``), in one MULTI; the lookup is its reconciler. Every request the
model answers is counted per run and turn (``<prefix>:pai-turns``), so a test can tell
whether a turn the log holds was requested again.

A fork's input may name the model ``whatif`` (``{"prompt": ..., "model": "whatif"}``): it
keeps, per run, the conversation it was shown (``<prefix>:pai-whatif``) and answers with
the last prompt.
"""

from __future__ import annotations

import json
import os
import re
import time
from typing import Any

import redis
from pydantic_ai import Agent, RunContext
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

import runlog
from runlog.integrations.pydantic_ai import ToolPolicy, register
from workers.common import fenced_effect, raise_floor

PREFIX = os.environ.get("RUNLOG_REDIS_KEY_PREFIX", "runlog")
STEP_S = float(os.environ.get("FLEET_TEST_STEP_S", "0.2"))
_client: redis.Redis | None = None


def client() -> redis.Redis:
    global _client
    if _client is None:
        _client = redis.Redis.from_url(os.environ["RUNLOG_REDIS_URL"])
    return _client


def _prompt(messages: list[ModelMessage]) -> str:
    for m in messages:
        if isinstance(m, ModelRequest):
            for part in m.parts:
                if isinstance(part, UserPromptPart) and isinstance(part.content, str):
                    return part.content
    raise AssertionError("no user prompt")


def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    found = re.fullmatch(r"order (\S+) steps (\d+)", _prompt(messages))
    assert found is not None
    order, steps = found.group(1), int(found.group(2))
    turn = sum(1 for m in messages if isinstance(m, ModelResponse))
    client().hincrby(f"{PREFIX}:pai-turns", f"{order}:{turn}", 1)
    if turn < steps:
        call = ToolCallPart("charge", {"order": order, "n": turn}, tool_call_id=f"c{turn}")
        return ModelResponse(parts=[call])
    return ModelResponse(parts=[TextPart(f"charged {order} {steps} times")])


agent = Agent(FunctionModel(script), name="pai-charger")


@agent.tool
def charge(ctx: RunContext[None], order: str, n: int) -> str:
    call = runlog.current_call()  # a framework tool: the key and token come from here
    key = call.idempotency_key
    time.sleep(STEP_S)  # in flight: a kill lands here
    result = f"charged {order} #{n}"
    landed = fenced_effect(
        client(),
        f"{PREFIX}:floors",
        key,
        call.fencing_token,
        counter=f"{PREFIX}:effects",
        results=f"{PREFIX}:results",
        result=result,
    )
    if not landed:
        raise runlog.ToolError(f"refused {key}: a newer owner holds the run")
    return result


def _lookup(
    args: dict[str, Any], *, idempotency_key: str, fencing_token: int
) -> runlog.Match | runlog.Absent:
    raise_floor(client(), f"{PREFIX}:floors", idempotency_key, fencing_token)
    found = client().hget(f"{PREFIX}:results", idempotency_key)
    if found is None:
        return runlog.Absent("no charge recorded under the key")
    return runlog.Match(found.decode())


def whatif(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    shown = [
        [type(m).__name__, type(p).__name__, str(getattr(p, "content", "")), p.tool_call_id]
        if isinstance(p, ToolCallPart | ToolReturnPart)
        else [type(m).__name__, type(p).__name__, str(getattr(p, "content", "")), None]
        for m in messages
        for p in m.parts
    ]
    last = shown[-1][2]
    client().hset(f"{PREFIX}:pai-whatif", _prompt(messages), json.dumps(shown))
    return ModelResponse(parts=[TextPart(f"what-if answered: {last}")])


register(
    "pai.charger",
    agent,
    tools={"charge": ToolPolicy("irreversible", reconcile=_lookup, receiver="fenced")},
    models={"whatif": FunctionModel(whatif)},
)
