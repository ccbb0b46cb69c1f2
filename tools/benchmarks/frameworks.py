"""8b. An agent framework's step, side by side: the framework alone and on runlog.

A step is one model turn proposing one tool call and the call itself (a scripted model, no
network; the tool returns the 300-byte result of ``steps.py``). Per framework:

* ``openai_agents_sqlite_session``: the OpenAI Agents SDK's ``Runner`` with its own
  persistence, an ``SQLiteSession`` on a file (the ``openai-agents`` extra);
* ``openai_agents_on_runlog``: the same agent through ``RunlogAgents`` (each turn a
  MODEL_TURN, each call runlog's ``irreversible`` call path);
* ``pydantic_ai_alone``: a Pydantic AI ``Agent`` on a ``FunctionModel``, no persistence;
* ``pydantic_ai_on_runlog``: the same agent with the ``RunlogDurability`` capability.

A loop of N steps is one agent run of N turns (plus the final answer).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from runlog._settings import Settings

RESULT = "r" * 300
Loop = Callable[[int], None]


def _openai_agents(settings: Settings, on_runlog: bool) -> Iterator[Loop]:
    from agents import Agent, Runner, SQLiteSession, function_tool, set_tracing_disabled
    from agents.items import ModelResponse
    from agents.models.interface import Model
    from agents.usage import Usage
    from openai.types.responses import (
        ResponseFunctionToolCall,
        ResponseOutputMessage,
        ResponseOutputText,
    )

    from runlog.integrations.openai_agents import RunlogAgents, ToolPolicy

    set_tracing_disabled(True)
    steps = {"n": 0}

    class Scripted(Model):
        async def get_response(
            self, system_instructions: Any, input: Any, *a: Any, **kw: Any
        ) -> Any:
            done = (
                0
                if isinstance(input, str)
                else sum(
                    1
                    for i in input
                    if isinstance(i, dict) and i.get("type") == "function_call_output"
                )
            )
            if done < steps["n"]:
                out: list[Any] = [
                    ResponseFunctionToolCall(
                        type="function_call",
                        call_id=f"c{done}",
                        name="lookup",
                        arguments=json.dumps({"i": done}),
                    )
                ]
            else:
                text = ResponseOutputText(type="output_text", text="done", annotations=[])
                out = [
                    ResponseOutputMessage(
                        id="m", type="message", role="assistant", status="completed", content=[text]
                    )
                ]
            return ModelResponse(output=out, usage=Usage(requests=1), response_id=None)

        async def stream_response(self, *a: Any, **kw: Any) -> Any:  # pragma: no cover
            raise NotImplementedError
            yield

    @function_tool
    def lookup(i: int) -> str:
        """Look something up."""
        return RESULT

    agent = Agent(name="bench", instructions="Look up.", model=Scripted(), tools=[lookup])
    durable = RunlogAgents(
        agent, tools={"lookup": ToolPolicy("irreversible")}, settings=settings, name="bench"
    )
    with tempfile.TemporaryDirectory() as tmp:

        def loop(n: int) -> None:
            steps["n"] = n
            if on_runlog:
                asyncio.run(
                    durable.run(
                        f"look up {n}", run_id=f"bench-oai-{uuid.uuid4().hex}", max_turns=n + 5
                    )
                )
            else:
                session = SQLiteSession(uuid.uuid4().hex, str(Path(tmp) / "sessions.db"))
                asyncio.run(Runner.run(agent, f"look up {n}", session=session, max_turns=n + 5))

        yield loop


def _pydantic_ai(settings: Settings, on_runlog: bool) -> Iterator[Loop]:
    from pydantic_ai import Agent
    from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
    from pydantic_ai.models.function import AgentInfo, FunctionModel
    from pydantic_ai.usage import UsageLimits

    from runlog.integrations.pydantic_ai_capability import RunlogDurability, ToolPolicy

    steps = {"n": 0}

    def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        turn = sum(1 for m in messages if isinstance(m, ModelResponse))
        if turn < steps["n"]:
            return ModelResponse(
                parts=[ToolCallPart("lookup", {"i": turn}, tool_call_id=f"c{turn}")]
            )
        return ModelResponse(parts=[TextPart("done")])

    caps = (
        [RunlogDurability(tools={"lookup": ToolPolicy("irreversible")}, settings=settings)]
        if on_runlog
        else []
    )
    agent: Agent[None, str] = Agent(FunctionModel(script), capabilities=caps, name="bench")

    @agent.tool_plain
    def lookup(i: int) -> str:
        return RESULT

    def loop(n: int) -> None:
        steps["n"] = n
        agent.run_sync(
            f"look up {n}",
            run_id=f"bench-pai-{uuid.uuid4().hex}",
            usage_limits=UsageLimits(request_limit=n + 5),
        )

    yield loop


def systems(settings: Settings) -> dict[str, Callable[[], contextlib.AbstractContextManager[Loop]]]:
    """The frameworks installed here, alone and on runlog."""
    out: dict[str, Callable[[], contextlib.AbstractContextManager[Loop]]] = {}
    if importlib.util.find_spec("agents") is not None:
        out["openai_agents_sqlite_session"] = contextlib.contextmanager(
            lambda: _openai_agents(settings, False)
        )
        out["openai_agents_on_runlog"] = contextlib.contextmanager(
            lambda: _openai_agents(settings, True)
        )
    if importlib.util.find_spec("pydantic_ai") is not None:
        out["pydantic_ai_alone"] = contextlib.contextmanager(lambda: _pydantic_ai(settings, False))
        out["pydantic_ai_on_runlog"] = contextlib.contextmanager(
            lambda: _pydantic_ai(settings, True)
        )
    return out
