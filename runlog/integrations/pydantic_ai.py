"""A Pydantic AI agent whose run is a runlog run (``pip install 'runlog[pydantic-ai]'``).

``RunlogAgent(agent, tools={...})`` is the wrapper shape of runlog's first integration, kept
as a thin shim over the capability (``runlog.integrations.pydantic_ai_capability``,
``Agent(capabilities=[RunlogDurability(...)])``), which is the one implementation: each
``RunlogAgent.run`` opens the run and runs the wrapped agent with a ``RunlogDurability``
bound to it. Both are made of the same pieces (``_pydantic_ai_parts``, private):

* **Model requests** go through ``RunlogModel``: the n-th request of a run returns the n-th
  MODEL_TURN of its log when there is one (the whole ``ModelResponse``, kept in the event's
  ``response_json``), and otherwise asks the wrapped model and records a MODEL_TURN (text,
  tool-call proposals with the keys they will run under, usage, cost, the whole response),
  durable before anything but a safe call acts on it and before the model is asked again.
  A resumed run therefore never asks the model again for a turn the log holds, and its
  agent loop sees exactly the history the dead one saw. A streamed request is served from
  the whole response, recorded (or replayed) first.
* **Tool calls** go through ``RunlogToolset`` to ``AsyncRun.call_tool``: STARTED durable
  before the tool runs, the idempotency key and the fencing token in
  ``runlog.current_call()``, the result recorded, recovery by the tool's risk class and
  reconciler. A tool call's operation id is its model turn and the model's call id, so its
  key does not depend on the order in which the agent executes the calls of a turn.
* **Approvals**: a tool declared with ``requires_approval=True`` (or raising
  ``ApprovalRequired``) becomes a runlog approval request (kind ``action``, the call's
  key), decided with ``runlog approve``/``reject`` or ``runlog.aio.decide``; until then the
  run raises ``runlog.Escalated``, and the next ``run`` with the run id goes on with the
  decision.

Starting and resuming are the same call: ``await agent.run(prompt)`` starts a run;
``await agent.run(run_id=...)`` resumes it after a crash at any point. With the fleet,
``register("name", agent, tools={...})`` registers it like ``@runlog.agent``: the worker
that owns the run opens it and drives the agent on it (``RunlogAgent.run_on``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping
from typing import Any, Generic

from runlog.integrations._common import missing_extra

try:
    from pydantic_ai import Agent, DeferredToolRequests
    from pydantic_ai.messages import ModelMessage
    from pydantic_ai.models import Model
    from pydantic_ai.usage import UsageLimits
except ModuleNotFoundError as exc:
    raise missing_extra(exc, __name__, "pydantic-ai", ("pydantic_ai",)) from exc

from runlog import aio
from runlog._settings import Settings
from runlog.integrations._common import (
    SUMMARY_CHARS,
    ToolPolicy,
    policies,
    recorded_events,
)
from runlog.integrations._pydantic_ai_parts import (
    Cost,
    DepsT,
    OutputT,
    RunlogModel,
    RunlogResult,
    RunlogToolset,
    default_cost,
    fork_base,
)
from runlog.integrations.pydantic_ai_capability import RunlogDurability
from runlog.producers._context import CallContext, current_call
from runlog.producers._tools import Tool

__all__ = [
    "CallContext",
    "RunlogAgent",
    "RunlogModel",
    "RunlogResult",
    "RunlogToolset",
    "ToolPolicy",
    "current_call",
    "policies",
    "register",
]


class RunlogAgent(Generic[DepsT, OutputT]):
    """Runs ``agent`` as a runlog run: recorded, fenced, resumable after a crash anywhere.

    ``tools`` maps tool names to their ``ToolPolicy`` (risk class and reconciler); a tool
    not named is ``safe``. Tool functions read their idempotency key and the writer's
    fencing token with ``runlog.current_call()``.
    """

    def __init__(
        self,
        agent: Agent[DepsT, OutputT],
        *,
        tools: Mapping[str, ToolPolicy] | None = None,
        tenant: str = "default",
        settings: Settings | None = None,
        name: str | None = None,
        cost: Cost = default_cost,
    ) -> None:
        self.wrapped = agent
        self.policies = dict(tools or {})
        self.tenant = tenant
        self.settings = settings
        self.name = name or agent.name or "pydantic-ai"
        self._cost = cost

    async def run(
        self,
        user_prompt: str | None = None,
        *,
        run_id: str | None = None,
        deps: DepsT = None,  # type: ignore[assignment]
        goal: str = "",
        approval_wait_s: float = 0.0,
        wait_s: float | None = None,
        takeover: bool = False,
        reason: str = "",
        on_open: Callable[[str], None] | None = None,
        usage_limits: UsageLimits | None = None,
        model: Model | None = None,
    ) -> RunlogResult[OutputT]:
        """Start (``run_id=None``) or resume the run; the same call either way.

        A fork (``runlog.fork``) of a run of this agent continues its parent's conversation
        at the fork point (the parent's messages, compactions included) with ``user_prompt``
        (recorded in the fork, so a resumption replays it) or, without one, from where the
        parent was; ``model`` asks another model than the agent's for the turns the log
        does not hold (a what-if: another prompt, another model).

        Returns once the agent produced its output and RUN_FINISHED is durable. Raises
        ``runlog.Escalated`` (with ``approval_id``) when a person must decide first: an
        approval-required tool call, or an uncertain call recovery could not settle;
        ``runlog.CallUncertain`` when a call's outcome stays unknown; ``runlog.Fenced``
        when another worker took the run over. ``on_open(run_id)`` is called once the run
        is open (recovered, before the agent runs): a new run's id, to resume it with.
        """
        tools = await self.runlog_tools(deps)
        async with aio.open_run(
            run_id,
            tenant=self.tenant,
            tools=tools,
            settings=self.settings,
            wait_s=wait_s,
            agent=self.name,
            goal=goal or (user_prompt or "")[:SUMMARY_CHARS],
            reason=reason,
            takeover=takeover,
        ) as run:
            if on_open is not None:
                on_open(run.run_id)
            return await self.run_on(
                run,
                user_prompt,
                deps=deps,
                approval_wait_s=approval_wait_s,
                usage_limits=usage_limits,
                model=model,
            )

    async def run_on(
        self,
        run: aio.AsyncRun,
        user_prompt: str | None = None,
        *,
        deps: DepsT = None,  # type: ignore[assignment]
        approval_wait_s: float = 0.0,
        usage_limits: UsageLimits | None = None,
        model: Model | None = None,
    ) -> RunlogResult[OutputT]:
        """Drive the agent on a run someone else opened (a fleet worker, ``register``).

        The run must have been opened with this agent's tools (``runlog_tools``), so that
        recovery inside ``open_run`` settled its uncertain calls by their policies. The
        same rules as ``run``: turns the log holds are replayed, not requested again.
        """
        resumed = run.state.seq > 1
        events: list[Any] | None = None
        history: list[ModelMessage] | None = None
        if run.state.lineage is None:
            recorded = next((m.content for m in run.state.messages if m.role == "user"), None)
            prompt = user_prompt if recorded is None else recorded
            if prompt is None:
                raise ValueError(f"run {run.run_id} has no task yet: pass user_prompt")
        else:
            # A fork: the agent's loop is handed the parent's conversation as its history,
            # so a fork given no prompt goes on from it (the parent's pending calls first);
            # the capability records the prompt and numbers the turns (read once, here).
            events = await recorded_events(run)
            base = fork_base(events)
            history = base.history
            prompt = user_prompt if base.prompt is None else base.prompt
        cap = self._capability(run, approval_wait_s, events)
        with Agent.parallel_tool_call_execution_mode("sequential"):
            result = await self.wrapped.run(
                prompt,
                run_id=run.run_id,
                message_history=history,
                model=model,
                deps=deps,
                usage_limits=usage_limits,
                capabilities=[cap],
            )
        output: Any = result.output
        if isinstance(output, DeferredToolRequests):
            names = ", ".join(p.tool_name for p in output.calls)
            raise NotImplementedError(
                f"run {run.run_id}: deferred (external) tool calls are not mapped to runlog: "
                f"{names}; declare them as tools the agent runs, or use requires_approval"
            )
        return RunlogResult(
            run_id=run.run_id,
            output=output,
            messages=result.all_messages(),
            resumed=resumed,
            replayed_turns=cap.replayed_turns,
            requested_turns=cap.requested_turns,
        )

    async def runlog_tools(self, deps: DepsT = None) -> list[Tool]:  # type: ignore[assignment]
        """The runlog tools to open a run of this agent with (risk class, reconciler)."""
        return await self._capability(None, 0.0).runlog_tools(deps)

    def _capability(
        self,
        run: aio.AsyncRun | None,
        approval_wait_s: float,
        events: list[Any] | None = None,
    ) -> RunlogDurability:
        """The ``RunlogDurability`` this agent's run is driven by (on ``run``, already open;
        ``events``: its valid events, when already read)."""
        return RunlogDurability(
            tools=self.policies,
            tenant=self.tenant,
            settings=self.settings,
            name=self.name,
            approval_wait_s=approval_wait_s,
            cost=self._cost,
        ).on(self.wrapped, run, events=events)


def register(
    name: str,
    agent: Agent[None, Any] | RunlogAgent[None, Any],
    *,
    tools: Mapping[str, ToolPolicy] | None = None,
    version: str | None = None,
    retries: int = 0,
    usage_limits: UsageLimits | None = None,
    models: Mapping[str, Model] | None = None,
) -> RunlogAgent[None, Any]:
    """Register a Pydantic AI agent with the fleet as ``name``, like ``@runlog.agent``.

    ``runlog.start(name, input)`` then runs it on whichever ``runlog worker`` owns the run:
    the input is the user prompt (a string, or ``{"prompt": ..., "model": ...}``), the
    agent's output the run's summary. ``"model"`` names one of ``models`` (else it is
    given to Pydantic AI's ``infer_model``, e.g. ``"openai:gpt-4o"``); without it the
    agent's own model answers. A fork (``runlog.fork(run, at_seq=N, input=...)``) goes on
    from its parent's conversation at N with its own input's prompt and model (none: as
    the parent stood). A worker that dies mid-run has its run resumed by another: model
    turns the log holds are replayed, tool calls settled by their policies (``tools``, as
    for ``RunlogAgent``). Deps are None: what a tool needs comes from the input or the
    process. Call it at import time of the module named by ``runlog worker --agents``.
    """
    from runlog.fleet._registry import agent as register_agent

    wrapped = agent if isinstance(agent, RunlogAgent) else RunlogAgent(agent, tools=tools)
    # Tools are listed once, here: a FunctionToolset's tools need no I/O to list, and the
    # worker opens every run of the agent with them (recovery runs before the agent does).
    runlog_tools = asyncio.run(wrapped.runlog_tools(None))

    async def run_agent(run: aio.AsyncRun, input: Any) -> str:
        if run.state.lineage is not None:
            input = await _fork_input(run)  # its own, never the parent's task again
        prompt = input.get("prompt") if isinstance(input, dict) else input
        result = await wrapped.run_on(
            run,
            None if prompt is None else str(prompt),
            usage_limits=usage_limits,
            model=_chosen_model(input, models or {}),
        )
        return str(result.output)[:SUMMARY_CHARS]

    run_agent.__qualname__ = f"pydantic_ai.register.{name}"
    register_agent(
        name,
        tools=runlog_tools,
        version=version or _agent_version(wrapped),
        retries=retries,
    )(run_agent)
    return wrapped


async def _fork_input(run: aio.AsyncRun) -> Any:
    """The input a fork was given (its RUN_FORKED's), None when it was given none."""
    forked = (await recorded_events(run))[0].payload
    return None if forked.input_json is None else json.loads(forked.input_json)


def _chosen_model(input: Any, models: Mapping[str, Model]) -> Model | None:
    name = input.get("model") if isinstance(input, dict) else None
    if name is None:
        return None
    if name in models:
        return models[name]
    from pydantic_ai.models import infer_model

    return infer_model(str(name))


def _agent_version(wrapped: RunlogAgent[Any, Any]) -> str:
    """A digest of the agent's tool functions' source: changes when their code does."""
    import hashlib
    import inspect

    parts = [wrapped.name]
    for toolset in wrapped.wrapped.toolsets:
        for tool in getattr(toolset, "tools", {}).values():
            fn = getattr(tool, "function", None)
            try:
                parts.append(inspect.getsource(fn) if fn is not None else repr(tool))
            except (OSError, TypeError):
                parts.append(repr(tool))
    return "pai-" + hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]
