"""9. A Pydantic AI agent step, bare and as a runlog run, side by side.

The same ``Agent`` with the same scripted ``FunctionModel``: N model turns, each calling one
tool that returns a 300-byte string, then a final answer. Per step (one model turn and its
tool call), in this process, in the same sitting:

* ``bare``: ``agent.run``, nothing recorded (Pydantic AI's own cost, the floor);
* ``runlog_safe`` / ``runlog_irreversible``: ``RunlogAgent.run``: MODEL_TURN (with the whole
  response) and the tool's STARTED and COMPLETED through ``call_tool``, with the barriers
  and ownership checks the tool's risk class needs (open and finish included);
* ``runlog_replay``: the same call on the finished run: every turn answered from the log,
  no tool run (the cost of resuming a run of N steps, per step).

The overhead per step is ``runlog_* - bare``, paired by repeat. Wall time (median over
repeats) and process CPU per step. Needs the ``pydantic-ai`` extra; without it the section
says so.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

from runlog._settings import Settings
from runlog.producers._engine import RunDeps
from tools.benchmarks.common import TENANT, summary

RESULT = "r" * 300


def installed() -> bool:
    return importlib.util.find_spec("pydantic_ai") is not None


def _agent(n: int) -> Any:
    from pydantic_ai import Agent
    from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
    from pydantic_ai.models.function import AgentInfo, FunctionModel

    def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        turn = sum(1 for m in messages if isinstance(m, ModelResponse))
        if turn < n:
            call = ToolCallPart("lookup", {"i": turn}, tool_call_id=f"c{turn}")
            return ModelResponse(parts=[TextPart(f"step {turn}"), call])
        return ModelResponse(parts=[TextPart("done")])

    agent: Any = Agent(FunctionModel(script), name="bench")

    @agent.tool_plain  # type: ignore[untyped-decorator,misc,unused-ignore]  # Any without the extra
    def lookup(i: int) -> str:
        return RESULT

    return agent


async def _timed(go: Callable[[], Awaitable[Any]], n: int) -> tuple[float, float]:
    w0, c0 = time.perf_counter(), time.process_time()
    await go()
    return (time.perf_counter() - w0) / n, (time.process_time() - c0) / n


async def _measure(settings: Settings, n: int, repeats: int) -> dict[str, Any]:
    from pydantic_ai.usage import UsageLimits

    from runlog.integrations.pydantic_ai import RunlogAgent, ToolPolicy

    limits = UsageLimits(request_limit=None)
    agent = _agent(n)
    durable: dict[str, RunlogAgent[None, Any]] = {
        risk: RunlogAgent(
            agent, tools={"lookup": ToolPolicy(risk)}, tenant=TENANT, settings=settings
        )
        for risk in ("safe", "irreversible")
    }
    names = ("bare", "runlog_safe", "runlog_irreversible", "runlog_replay")
    walls: dict[str, list[float]] = {k: [] for k in names}
    cpus: dict[str, list[float]] = {k: [] for k in names}

    def note(name: str, wall: float, cpu: float) -> None:
        walls[name].append(wall * 1000)
        cpus[name].append(cpu * 1000)

    # Warm up: imports, connections, schema lookups, the agent's first graph build.
    await agent.run("warm up", usage_limits=limits)
    await durable["safe"].run("warm up", usage_limits=limits)

    async def live(risk: str, ids: list[str]) -> None:
        got = await durable[risk].run("go", usage_limits=limits)
        ids.append(got.run_id)

    async def resume(run_id: str) -> None:
        await durable["safe"].run(run_id=run_id, usage_limits=limits)

    for _ in range(repeats):
        note("bare", *await _timed(functools.partial(agent.run, "go", usage_limits=limits), n))
        ids: list[str] = []
        for risk in ("safe", "irreversible"):
            note(f"runlog_{risk}", *await _timed(functools.partial(live, risk, ids), n))
        note("runlog_replay", *await _timed(functools.partial(resume, ids[0]), n))
    out: dict[str, Any] = {"steps_per_repeat": n, "systems": {}}
    for name in names:
        out["systems"][name] = {
            "ms_per_step": summary(walls[name]),
            "cpu_ms_per_step": summary(cpus[name]),
        }
    # Paired by repeat (each repeat times every system back to back, under the same load):
    # the median of the per-repeat differences.
    paired = {
        name: [r - b for r, b in zip(walls[name], walls["bare"], strict=True)]
        for name in names
        if name != "bare"
    }
    out["overhead_ms_per_step"] = {k: round(statistics.median(v), 3) for k, v in paired.items()}
    return out


def measure(deps: RunDeps, settings: Settings, *, n: int, repeats: int) -> dict[str, Any]:
    if not installed():
        return {"status": "not measured: pip install -e '.[pydantic-ai]'"}
    return asyncio.run(_measure(settings, n, repeats))
