"""An OpenAI Agents SDK agent whose run is a runlog run (``pip install 'runlog[openai-agents]'``).

``RunlogAgents(agent, tools={...})`` runs an ``agents.Agent`` with ``Runner`` unchanged, on a
clone of the agent whose model and function tools are runlog's:

* **Model responses** go through ``RunlogModel`` (an ``agents.models.interface.Model`` that
  wraps the agent's): the n-th request of a run returns the n-th MODEL_TURN of its log when
  there is one (the response's output items, kept in ``response_json``), and otherwise asks
  the wrapped model and records a MODEL_TURN (text, tool-call proposals with the keys they
  will run under, usage, the whole output) before the runner acts on it. A resumed run never
  asks the model again for a turn its log holds. Streaming passes the wrapped model's events
  through; the completed response is recorded before its ``response.completed`` event is
  handed on, and a recorded turn is streamed as that one event.
* **Function tools** are called through ``AsyncRun.call_tool``: STARTED durable before the
  tool runs, its idempotency key and fencing token in ``runlog.current_call()``, a completed
  key answered from the log, recovery of an uncertain call by the tool's risk class and
  ``reconcile=``. A call's operation id is its model turn and the model's call id.
* **Approvals**: a tool with ``needs_approval`` makes the SDK stop with interruptions; each
  becomes a runlog approval request (kind ``action``, the call's key), decided with
  ``runlog approve``/``reject`` or ``runlog.aio.decide``; the decision is applied to the
  SDK's ``RunState`` (``approve``/``reject``) and the runner continues.
* **Session**: ``RunlogAgents(agent, session=True)`` runs the agent with an SDK ``Session``
  whose history is the run's log (``runlog.integrations._openai_agents_session``).
* **Fleet**: ``durable.register("billing")`` registers it with ``@runlog.agent``; the
  worker runs it on the ``AsyncRun`` it opened (``durable.run_on(run, input)``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Callable, Generator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from pydantic import TypeAdapter

from runlog import aio
from runlog.integrations._common import missing_extra

try:
    from agents import Agent, FunctionTool, Runner
    from agents.items import ModelResponse, TResponseOutputItem
    from agents.models.interface import Model
    from agents.tool_context import ToolContext
    from agents.usage import Usage
    from openai.types.responses import (
        Response,
        ResponseCompletedEvent,
        ResponseFunctionToolCall,
        ResponseOutputMessage,
    )
except ModuleNotFoundError as exc:
    raise missing_extra(exc, __name__, "openai-agents", ("agents", "openai")) from exc

from runlog._settings import Settings
from runlog.errors import RunlogError, ToolFailed
from runlog.fleet._registry import agent as register_agent
from runlog.integrations._approvals import approval_for, await_decision, rejection_note
from runlog.integrations._common import (
    SUMMARY_CHARS,
    ToolPolicy,
    operation_id,
    policies,
    proposal,
    recorded_events,
)
from runlog.integrations._openai_agents_session import RunlogSession, recorded_ops
from runlog.producers._context import CallContext, current_call
from runlog.producers._tools import Tool
from runlog.schemas._canonical import canonical_json
from runlog.schemas._keys import check_run_id, new_run_id
from runlog.schemas._vocabulary import EventType

__all__ = [
    "CallContext",
    "RunlogAgents",
    "RunlogHandle",
    "RunlogModel",
    "RunlogResult",
    "RunlogSession",
    "ToolPolicy",
    "current_call",
    "policies",
]

_LIVE_CTX: ContextVar[ToolContext[Any] | None] = ContextVar("runlog_oai_tool_ctx", default=None)
_OUTPUT_ITEMS: TypeAdapter[list[TResponseOutputItem]] = TypeAdapter(list[TResponseOutputItem])


@dataclass
class RunlogResult:
    """What ``RunlogAgents.run`` returns once the run finished."""

    run_id: str
    output: Any
    resumed: bool
    replayed_turns: int
    """Model turns answered from the log instead of the model."""
    requested_turns: int
    """Model turns the wrapped model was asked for in this call."""


@dataclass(frozen=True)
class RunlogHandle:
    """A run ``RunlogAgents.start`` began: its id at once, its result when awaited."""

    run_id: str
    task: asyncio.Future[RunlogResult]

    def __await__(self) -> Generator[Any, None, RunlogResult]:
        return self.task.__await__()


@dataclass
class _Execution:
    run: aio.AsyncRun
    recorded: list[ModelResponse]
    next_turn: int = 0
    requested: int = 0
    turn_of_call: dict[str, int] = field(default_factory=dict)

    def operation_id(self, call_id: str) -> str:
        turn = self.turn_of_call.get(call_id, self.next_turn - 1)
        return operation_id(self.run.run_id, turn, call_id)

    def take(self) -> tuple[int, ModelResponse | None]:
        turn = self.next_turn
        return turn, self.recorded[turn] if turn < len(self.recorded) else None

    def used(self, turn: int, response: ModelResponse) -> None:
        self.next_turn = turn + 1
        for item in response.output:
            if isinstance(item, ResponseFunctionToolCall):
                self.turn_of_call[item.call_id] = turn


def _text_of(response: ModelResponse) -> str:
    parts = []
    for item in response.output:
        if isinstance(item, ResponseOutputMessage):
            for c in item.content:
                text = getattr(c, "text", None)
                if isinstance(text, str):
                    parts.append(text)
    return "".join(parts)


def _record(ex: _Execution, turn: int, response: ModelResponse) -> None:
    run = ex.run
    proposals = []
    for item in response.output:
        if not isinstance(item, ResponseFunctionToolCall):
            continue
        try:
            args = json.loads(item.arguments or "{}")
            args_json = canonical_json(args)
        except ValueError:
            args, args_json = None, item.arguments or "{}"
        op = operation_id(run.run_id, turn, item.call_id)
        proposals.append(proposal(run, op, item.call_id, item.name, args, args_json))
    body = {
        "output": [it.model_dump(mode="json", exclude_none=True) for it in response.output],
        "usage": {
            "requests": response.usage.requests,
            "input_tokens": response.usage.input_tokens,
            "output_tokens": response.usage.output_tokens,
            "total_tokens": response.usage.total_tokens,
        },
        "response_id": response.response_id,
    }
    # Pipelined: the next act on this response (a non-safe call's STARTED, an approval, the
    # next model request, RUN_FINISHED) is a barrier; only a safe call may run before it.
    run.emit(
        EventType.MODEL_TURN,
        text=_text_of(response),
        tool_calls=proposals,
        usage={
            "input_tokens": response.usage.input_tokens,
            "output_tokens": response.usage.output_tokens,
        },
        cost_usd=0.0,
        response_json=json.dumps(body, sort_keys=True),
    )


def _response_of(payload: Any) -> ModelResponse:
    """A recorded MODEL_TURN as the response the model gave."""
    body = json.loads(payload.response_json or "{}")
    usage = body.get("usage", {})
    return ModelResponse(
        output=_OUTPUT_ITEMS.validate_python(body.get("output", [])),
        usage=Usage(
            requests=int(usage.get("requests", 1)),
            input_tokens=int(usage.get("input_tokens", 0)),
            output_tokens=int(usage.get("output_tokens", 0)),
            total_tokens=int(usage.get("total_tokens", 0)),
        ),
        response_id=body.get("response_id"),
    )


class RunlogModel(Model):
    """Answers each request from the run's log when it holds that turn, else asks the
    wrapped model and records the response (MODEL_TURN) before the runner uses it."""

    def __init__(self, wrapped: Model, execution: _Execution) -> None:
        self.wrapped = wrapped
        self._execution = execution

    async def _before_asking(self) -> None:
        # The previous turn (and what the agent did with it) is durable before the model is
        # asked again: at most the latest answer can be lost, never a recorded one.
        await self._execution.run.barrier()
        await self._execution.run.check_cancelled()

    async def get_response(self, *args: Any, **kw: Any) -> ModelResponse:
        ex = self._execution
        turn, response = ex.take()
        if response is None:
            await self._before_asking()
            response = await self.wrapped.get_response(*args, **kw)
            ex.requested += 1
            _record(ex, turn, response)
        ex.used(turn, response)
        return response

    async def stream_response(self, *args: Any, **kw: Any) -> AsyncIterator[Any]:
        ex = self._execution
        turn, response = ex.take()
        if response is not None:
            ex.used(turn, response)
            yield _completed_event(response)
            return
        await self._before_asking()
        async for event in self.wrapped.stream_response(*args, **kw):
            if isinstance(event, ResponseCompletedEvent):
                got = event.response
                usage = got.usage
                response = ModelResponse(
                    output=list(got.output),
                    usage=Usage(
                        requests=1,
                        input_tokens=usage.input_tokens if usage else 0,
                        output_tokens=usage.output_tokens if usage else 0,
                        total_tokens=usage.total_tokens if usage else 0,
                    ),
                    response_id=got.id,
                )
                ex.requested += 1
                _record(ex, turn, response)
                await ex.run.barrier()  # recorded before the runner acts on the response
                ex.used(turn, response)
            yield event

    async def close(self) -> None:
        await self.wrapped.close()


def _completed_event(response: ModelResponse) -> ResponseCompletedEvent:
    return ResponseCompletedEvent(
        type="response.completed",
        sequence_number=0,
        response=Response(
            id=response.response_id or "runlog-replayed",
            created_at=0,
            model="runlog-replay",
            object="response",
            output=list(response.output),
            parallel_tool_calls=False,
            tool_choice="auto",
            tools=[],
        ),
    )


def _encode(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str, sort_keys=True)


class RunlogAgents:
    """Runs an OpenAI Agents SDK ``agent`` as a runlog run: recorded, fenced, resumable.

    ``tools`` maps function-tool names to their ``ToolPolicy``; a tool not named is
    ``safe``. Tool functions read their idempotency key and the writer's fencing token with
    ``runlog.current_call()``.
    """

    def __init__(
        self,
        agent: Agent[Any],
        *,
        tools: Mapping[str, ToolPolicy] | None = None,
        tenant: str = "default",
        settings: Settings | None = None,
        name: str | None = None,
        session: bool = False,
    ) -> None:
        if not isinstance(agent.model, Model):
            raise TypeError("RunlogAgents needs an Agent constructed with a Model instance")
        self.wrapped = agent
        self.policies = dict(tools or {})
        self.tenant = tenant
        self.settings = settings
        self.name = name or agent.name or "openai-agents"
        self.session = session
        self._functions = {t.name: t for t in agent.tools if isinstance(t, FunctionTool)}
        unknown = set(self.policies) - set(self._functions)
        if unknown:
            raise ValueError(f"policies for tools the agent does not have: {sorted(unknown)}")

    # The runlog tools: what open_run (or @runlog.agent) is given --------------------------
    def runlog_tools(self) -> list[Tool]:
        out = []
        for name, tool in self._functions.items():
            policy = self.policies.get(name, ToolPolicy())
            out.append(policy.tool(name, _invoker(tool)))
        return out

    def register(self, name: str | None = None, **options: Any) -> Callable[..., Any]:
        """Register this agent with the fleet (``@runlog.agent``) under ``name``."""

        async def run_agent(run: aio.AsyncRun, input: Any) -> str:
            got = await self.run_on(run, None if input is None else str(input))
            return str(got.output)[:SUMMARY_CHARS]

        run_agent.__qualname__ = f"RunlogAgents[{name or self.name}]"
        return register_agent(name or self.name, tools=self.runlog_tools(), **options)(run_agent)

    # Runs ---------------------------------------------------------------------------------
    async def run(
        self,
        input: str | None = None,
        *,
        run_id: str | None = None,
        goal: str = "",
        approval_wait_s: float = 0.0,
        wait_s: float | None = None,
        takeover: bool = False,
        reason: str = "",
        context: Any = None,
        max_turns: int = 50,
        on_event: Callable[[Any], Any] | None = None,
        on_open: Callable[[str], Any] | None = None,
    ) -> RunlogResult:
        """Start (``run_id=None``) or resume the run and drive it to its end; the same call
        either way. ``on_event`` streams the runner's events (``Runner.run_streamed``).
        ``on_open(run_id)`` (it may be ``async``) is called once the run is open and
        recovered, before the model is first asked: keep a new run's id there, so a caller
        that dies before ``run`` returns can resume it (``run(input, run_id=...)``).
        Raises ``runlog.Escalated`` when a person must decide first."""
        async with aio.open_run(
            run_id,
            tenant=self.tenant,
            tools=self.runlog_tools(),
            settings=self.settings,
            wait_s=wait_s,
            agent=self.name,
            goal=goal or (input or "")[:SUMMARY_CHARS],
            reason=reason,
            takeover=takeover,
        ) as run:
            if on_open is not None:
                opened = on_open(run.run_id)
                if asyncio.iscoroutine(opened):
                    await opened
            got = await self.run_on(
                run,
                input,
                approval_wait_s=approval_wait_s,
                context=context,
                max_turns=max_turns,
                on_event=on_event,
            )
            if run.state.status != "finished":
                await run.finish("succeeded", str(got.output)[:SUMMARY_CHARS])
            return got

    def start(self, input: str, *, run_id: str | None = None, **options: Any) -> RunlogHandle:
        """Begin the run in a task of the running event loop and return its handle at once:
        ``handle.run_id`` is known before anything is appended (minted here when not given),
        so a caller can keep it before the model is ever asked; ``await handle`` is what
        ``run`` returns. Resuming is ``run(input, run_id=handle.run_id)`` (the same input:
        a run that died before recording its task needs it again; one that recorded it
        replays the recorded one). ``options`` are ``run``'s."""
        loop = asyncio.get_running_loop()  # before the coroutine exists: none left unawaited
        rid = check_run_id(run_id) if run_id is not None else new_run_id()
        return RunlogHandle(rid, loop.create_task(self.run(input, run_id=rid, **options)))

    async def run_on(
        self,
        run: aio.AsyncRun,
        input: str | None,
        *,
        approval_wait_s: float = 0.0,
        context: Any = None,
        max_turns: int = 50,
        on_event: Callable[[Any], Any] | None = None,
    ) -> RunlogResult:
        """Run the agent on an already opened run (a fleet worker's); does not finish it."""
        resumed = run.state.seq > 1
        recorded_input = next((m.content for m in run.state.messages if m.role == "user"), None)
        if recorded_input is None:
            if input is None:
                raise ValueError(f"run {run.run_id} has no task yet: pass input")
            run.emit(EventType.USER_MESSAGE, content=input)
            prompt = input
        else:
            prompt = recorded_input  # a resumption replays the task it was given
        events = await self._recorded_events(run)
        ex = _Execution(
            run, [_response_of(e.payload) for e in events if e.type is EventType.MODEL_TURN]
        )
        session = (
            RunlogSession(run, recorded=recorded_ops(events, run.run_id), replay=True)
            if self.session
            else None
        )
        assert isinstance(self.wrapped.model, Model)
        clone = self.wrapped.clone(
            model=RunlogModel(self.wrapped.model, ex),
            tools=[self._through_runlog(t, ex) for t in self.wrapped.tools],
        )
        state: Any = prompt
        while True:
            try:
                result = await _run_once(clone, state, context, max_turns, on_event, session)
            except Exception as exc:
                cause = _runlog_cause(exc)
                if cause is exc:
                    raise
                raise cause from None  # its own traceback still shows where it was raised
            if not result.interruptions:
                break
            state = result.to_state()
            for item in result.interruptions:
                approval = await await_decision(
                    run, await self._approval_for(ex, item), approval_wait_s
                )
                if approval.approved:
                    state.approve(item)
                else:
                    state.reject(item, rejection_message=rejection_note(approval))
        return RunlogResult(
            run_id=run.run_id,
            output=result.final_output,
            resumed=resumed,
            replayed_turns=min(ex.next_turn, len(ex.recorded)),
            requested_turns=ex.requested,
        )

    def _through_runlog(self, tool: Any, ex: _Execution) -> Any:
        if not isinstance(tool, FunctionTool):
            return tool

        async def on_invoke(ctx: ToolContext[Any], input_json: str) -> Any:
            args = json.loads(input_json or "{}")
            token = _LIVE_CTX.set(ctx)
            try:
                return await ex.run.call_tool(
                    tool.name,
                    args,
                    operation_id=ex.operation_id(ctx.tool_call_id),
                    call_id=ctx.tool_call_id or None,
                )
            finally:
                _LIVE_CTX.reset(token)

        return dataclasses.replace(tool, on_invoke_tool=on_invoke)

    async def _approval_for(self, ex: _Execution, item: Any) -> str:
        run = ex.run
        raw = item.raw_item
        name = item.tool_name or getattr(raw, "name", "")
        call_id = getattr(raw, "call_id", "") or ""
        arguments = getattr(raw, "arguments", "{}") or "{}"
        args = json.loads(arguments)
        key = run.key_for(name, args, operation_id=ex.operation_id(call_id))
        return await approval_for(run, name, canonical_json(args), key)

    async def _recorded_events(self, run: aio.AsyncRun) -> list[Any]:
        # A fresh run has nothing to replay; a session records before the first turn.
        if run.state.turns == 0 and not (self.session and run.state.resumptions):
            return []
        return await recorded_events(run)


async def _run_once(
    agent: Agent[Any],
    state: Any,
    context: Any,
    max_turns: int,
    on_event: Callable[[Any], Any] | None,
    session: RunlogSession | None = None,
) -> Any:
    if on_event is None:
        return await Runner.run(agent, state, context=context, max_turns=max_turns, session=session)
    result = Runner.run_streamed(
        agent, state, context=context, max_turns=max_turns, session=session
    )
    async for event in result.stream_events():
        handled = on_event(event)
        if asyncio.iscoroutine(handled):
            await handled
    return result


def _runlog_cause(exc: BaseException) -> BaseException:
    """The runlog error behind what the SDK raised, else what it raised.

    The SDK wraps an exception from a tool in its own ``UserError``; runlog's (``Fenced``,
    ``Escalated``, ``CallUncertain``, ...) say what happened to the run and must reach the
    caller as themselves. A tool's own proven failure (``ToolFailed``) stays the SDK's."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, RunlogError) and not isinstance(seen, ToolFailed):
            return seen
        seen = seen.__cause__ or seen.__context__
    return exc


def _invoker(tool: FunctionTool) -> Callable[..., Any]:
    async def invoke(args: dict[str, Any], *, idempotency_key: str) -> str:
        ctx = _LIVE_CTX.get()
        input_json = json.dumps(args)
        if ctx is None:
            # Recovery retries a call inside open_run, before the agent runs again.
            ctx = ToolContext(
                context=None,
                tool_name=tool.name,
                tool_call_id=f"recovery-{idempotency_key}",
                tool_arguments=input_json,
            )
        return _encode(await tool.on_invoke_tool(ctx, input_json))

    return invoke
