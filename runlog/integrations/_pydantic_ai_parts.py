"""The pieces a Pydantic AI run on runlog is made of: the recording model, the toolset
that routes tool calls to ``AsyncRun.call_tool``, an execution's replay state and the fork
base. Private: ``runlog.integrations.pydantic_ai`` is the public face; the capability
(``pydantic_ai_capability``) and the agent wrapper (``RunlogAgent``) are both built on
these, so neither needs the other's module to have them.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from runlog.integrations._common import missing_extra
from runlog.producers._handle import engine_of

try:
    from pydantic_ai import Agent
    from pydantic_ai.exceptions import ApprovalRequired, CallDeferred, ModelRetry
    from pydantic_ai.messages import (
        ModelMessage,
        ModelMessagesTypeAdapter,
        ModelRequest,
        ModelRequestPart,
        ModelResponse,
        RetryPromptPart,
        TextPart,
        ToolCallPart,
        ToolReturnPart,
        UserPromptPart,
    )
    from pydantic_ai.models import (
        CompletedStreamedResponse,
        Model,
        ModelRequestParameters,
        StreamedResponse,
    )
    from pydantic_ai.models.wrapper import WrapperModel
    from pydantic_ai.settings import ModelSettings
    from pydantic_ai.tools import RunContext
    from pydantic_ai.toolsets import AbstractToolset, ToolsetTool, WrapperToolset
    from pydantic_ai.usage import RunUsage
    from pydantic_core import to_json
except ModuleNotFoundError as exc:
    raise missing_extra(exc, __name__, "pydantic-ai", ("pydantic_ai",)) from exc

from runlog import aio
from runlog.errors import ToolArgumentsError, ToolFailed
from runlog.integrations._approvals import approval_for
from runlog.integrations._common import (
    operation_id,
    proposal,
)
from runlog.projections._messages import Message
from runlog.projections._run_state import fold
from runlog.schemas._canonical import canonical_json
from runlog.schemas._vocabulary import EventType

if TYPE_CHECKING:
    pass

DepsT = TypeVar("DepsT")
OutputT = TypeVar("OutputT")


@dataclass
class RunlogResult(Generic[OutputT]):
    """What ``RunlogAgent.run`` returns once the run finished."""

    run_id: str
    output: OutputT
    messages: list[ModelMessage]
    resumed: bool
    """True when the run had events before this call (a resumption or a re-execution)."""
    replayed_turns: int
    """Model turns answered from the log instead of the model."""
    requested_turns: int
    """Model turns the wrapped model was asked for in this call."""


@dataclass
class _Live:
    """The Pydantic AI call a runlog tool invocation belongs to."""

    ctx: RunContext[Any]
    tool: ToolsetTool[Any]
    toolset: AbstractToolset[Any]
    deferred: CallDeferred | ApprovalRequired | None = None
    """Control flow the tool raised (approval needed, deferred): recorded as a proven
    failure (nothing happened) and raised again to Pydantic AI."""
    retry: str | None = None
    """The message of the ``ModelRetry`` the tool raised, as recorded."""


LIVE: ContextVar[_Live | None] = ContextVar("runlog_pydantic_ai_call", default=None)


@dataclass
class Execution:
    """One ``RunlogAgent.run`` call: the run, the recorded turns, the turn counter."""

    run: aio.AsyncRun
    recorded: list[ModelResponse]
    deps: Any
    next_turn: int = 0
    requested: int = 0
    turn_of_call: dict[str, int] = field(default_factory=dict)
    failures: dict[tuple[int, str], str] = field(default_factory=dict)
    """Proven failures in the log by (turn, model's call id): what the agent was told."""
    base: ForkBase | None = None
    """A fork's: the conversation it took from its parent (see ``ForkBase``)."""
    shown_before: list[ModelMessage] = field(default_factory=list)
    """Messages the model is shown before the agent's own (a fork's parent conversation,
    when the agent's loop was not handed it as its ``message_history``)."""

    def __post_init__(self) -> None:
        turn = -1
        messages = self.run.state.messages
        if self.base is not None:
            messages = messages[len(self.base.messages) :]  # the fork's own
            for part in self.base.pending:  # the parent's last turn: turn -1 of the fork
                self.turn_of_call[part.tool_call_id or ""] = -1
        for message in messages:
            if message.role == "assistant":
                turn += 1
            elif message.tool_result is not None and message.tool_result.is_error:
                result = message.tool_result
                self.failures[(turn, result.call_id)] = result.content

    def operation_id(self, tool_call_id: str) -> str:
        """The call's scope for its idempotency key: the turn that proposed it and the
        model's call id (both replayed identically), so the key does not depend on the
        order in which the agent runs a turn's calls."""
        return self.scope(self.turn_of_call.get(tool_call_id, self.next_turn - 1), tool_call_id)

    def scope(self, turn: int, tool_call_id: str) -> str:
        """A fork numbers its turns after its parent's and scopes keys like its root (the
        lineage's key scope), so a call of the parent's last turn that the fork makes is
        the parent's logical action (``runlog.producers._timelines`` decides what it does);
        outside a fork both are the run's own."""
        offset = 0 if self.base is None else self.base.turns
        return operation_id(engine_of(self.run).key_scope, offset + turn, tool_call_id)


@dataclass(frozen=True)
class ForkBase:
    """What a fork of a Pydantic AI run starts from: the parent's conversation at the fork
    point (its state's messages, compactions applied), as Pydantic AI messages, and the
    prompt the fork was given (its first USER_MESSAGE), if any."""

    messages: list[Message]
    turns: int
    history: list[ModelMessage]
    prompt: str | None

    @property
    def pending(self) -> list[ToolCallPart]:
        """Tool calls of the history's last response without a result (the agent runs
        them first: the fork's effects mode decides what each does)."""
        last = self.history[-1] if self.history else None
        return list(last.tool_calls) if isinstance(last, ModelResponse) else []


def history_of(messages: list[Message]) -> list[ModelMessage]:
    """A run's conversation (``RunState.messages``, compactions applied) as the Pydantic AI
    messages a model is shown: a user message and tool results are parts of a request
    (consecutive ones of one request), an assistant turn is a response with its text and
    tool calls; a failed call's result is a retry prompt, as the agent was told."""
    out: list[ModelMessage] = []
    parts: list[ModelRequestPart] = []
    for msg in messages:
        if msg.role == "assistant":
            if parts:
                out.append(ModelRequest(parts=parts))
                parts = []
            body: list[Any] = [TextPart(msg.content)] if msg.content else []
            body += [
                ToolCallPart(c["name"], c.get("args_json") or "{}", tool_call_id=c["call_id"])
                for c in msg.tool_calls
            ]
            out.append(ModelResponse(parts=body))
        elif msg.role == "user":
            parts.append(UserPromptPart(msg.content))
        elif msg.tool_result is not None:
            r = msg.tool_result
            if r.is_error:
                parts.append(RetryPromptPart(r.content, tool_name=r.name, tool_call_id=r.call_id))
            else:
                parts.append(ToolReturnPart(r.name, r.content, tool_call_id=r.call_id))
    if parts:
        out.append(ModelRequest(parts=parts))
    return out


def fork_base(events: list[Any]) -> ForkBase:
    """A fork's starting point, from its own log: RUN_FORKED holds the parent's state at the
    fork point; the fork's first USER_MESSAGE after it is the prompt it was given."""
    at_fork = fold(events[:1])
    prompt = next((e.payload.content for e in events[1:] if e.type is EventType.USER_MESSAGE), None)
    return ForkBase(at_fork.messages, at_fork.turns, history_of(at_fork.messages), prompt)


class RunlogModel(WrapperModel):
    """Answers each request from the run's log when it holds that turn, else asks the
    wrapped model and records the response (MODEL_TURN) before it is used."""

    def __init__(self, wrapped: Model, execution: Execution, cost: Cost) -> None:
        super().__init__(wrapped)
        self._execution = execution
        self._cost = cost

    async def request(
        self,
        messages: list[ModelMessage],
        model_settings: ModelSettings | None,
        model_request_parameters: ModelRequestParameters,
    ) -> ModelResponse:
        ex = self._execution
        turn = ex.next_turn
        if turn < len(ex.recorded):
            response = ex.recorded[turn]
        else:
            # The previous turn (and what the agent did with it) is durable before the model
            # is asked again: at most the latest answer can be lost, never a recorded one.
            await ex.run.barrier()
            await ex.run.check_cancelled()  # a person's cancellation, before the model
            response = await self.wrapped.request(
                [*ex.shown_before, *messages], model_settings, model_request_parameters
            )
            ex.requested += 1
            await _record_turn(ex, turn, response, self._cost(response))
        ex.next_turn = turn + 1
        for part in response.tool_calls:
            ex.turn_of_call[part.tool_call_id or ""] = turn
        return response

    @asynccontextmanager
    async def request_stream(
        self,
        messages: list[ModelMessage],
        model_settings: ModelSettings | None,
        model_request_parameters: ModelRequestParameters,
        run_context: RunContext[Any] | None = None,
    ) -> AsyncIterator[StreamedResponse]:
        # The whole response is recorded (or replayed) first, then streamed as its parts:
        # nothing reaches the caller that the log does not hold.
        response = await self.request(messages, model_settings, model_request_parameters)
        yield CompletedStreamedResponse(
            response, model_request_parameters=model_request_parameters, replay_events=True
        )


class RunlogToolset(WrapperToolset[DepsT]):
    """Sends every call of the wrapped toolset through ``AsyncRun.call_tool``."""

    def __init__(self, wrapped: AbstractToolset[DepsT], execution: Execution) -> None:
        super().__init__(wrapped)
        self._execution = execution

    async def call_tool(
        self, name: str, tool_args: dict[str, Any], ctx: RunContext[DepsT], tool: ToolsetTool[DepsT]
    ) -> Any:
        ex = self._execution
        call_id = ctx.tool_call_id or ""
        _replay_failure(ex, call_id, approved=ctx.tool_call_approved)
        live = _Live(ctx, tool, self.wrapped)
        token = LIVE.set(live)
        try:
            recorded = await ex.run.call_tool(
                name,
                tool_args,
                operation_id=ex.operation_id(call_id),
                call_id=call_id or None,
            )
        except ToolFailed as exc:
            if live.deferred is not None:
                raise live.deferred from None
            raise ModelRetry(live.retry or str(exc)) from exc
        finally:
            LIVE.reset(token)
        return recorded


DEFERRED_MARK = " asked to be deferred: "


def _replay_failure(ex: Execution, call_id: str, *, approved: bool) -> None:
    """Raise again, without running the tool, a proven failure the agent already acted on.

    A failure records no key (the action may be tried again), so without this a replayed
    turn would run the tool once more, and an attempt that now succeeded would put an
    effect in the world that the recorded history says failed. A failure is replayed when
    the model's next turn is in the log (the model saw it); a deferral (the tool asked for
    approval) is replayed until the call comes back approved.
    """
    turn = ex.turn_of_call.get(call_id)
    content = None if turn is None else ex.failures.get((turn, call_id))
    if content is None or turn is None:
        return
    if DEFERRED_MARK in content:
        if approved:
            return
        kind = content.rsplit(DEFERRED_MARK, 1)[1]
        raise CallDeferred() if kind == CallDeferred.__name__ else ApprovalRequired()
    if turn + 1 < len(ex.recorded):
        raise ModelRetry(content)


Cost = Callable[[ModelResponse], float]


def default_cost(response: ModelResponse) -> float:
    """The response's price from Pydantic AI's price data, or 0.0 when it has none."""
    try:
        return float(response.cost().total_price)
    except (LookupError, ValueError, AssertionError, AttributeError, TypeError):
        return 0.0


def encode_result(value: Any) -> str:
    """A tool's return value as the text runlog records: a string as it is, anything else
    as the JSON Pydantic AI would have sent the model. The agent is given this text, live
    and on replay alike, so a resumed run sees exactly what the dead one saw."""
    return value if isinstance(value, str) else to_json(value, fallback=str).decode()


def _args_json(part: ToolCallPart) -> tuple[str, dict[str, Any] | None]:
    try:
        args = part.args_as_dict()
        return canonical_json(args), args
    except (ValueError, ToolArgumentsError):
        raw = part.args if isinstance(part.args, str) else json.dumps(part.args, default=str)
        return raw or "{}", None


async def approval_for_part(ex: Execution, part: ToolCallPart) -> str:
    """The runlog approval for an approval-required call, keyed by the call's key."""
    run = ex.run
    args_json, args = _args_json(part)
    operation = ex.operation_id(part.tool_call_id or "")
    key = run.key_for(part.tool_name, args or {}, operation_id=operation)
    return await approval_for(run, part.tool_name, args_json, key)


async def _record_turn(ex: Execution, turn: int, response: ModelResponse, cost: float) -> None:
    run = ex.run
    proposals = []
    for part in response.tool_calls:
        # A model that gives no call id (None, which Pydantic AI's own message schema cannot
        # read back) is given the empty one here, in the response the agent goes on with as
        # in the record, so a replay is the live run; the key is still scoped by the turn.
        part.tool_call_id = part.tool_call_id or ""
        args_json, args = _args_json(part)
        op = ex.scope(turn, part.tool_call_id)
        proposals.append(proposal(run, op, part.tool_call_id, part.tool_name, args, args_json))
    # Pipelined: the agent's next act on this response waits for it (a non-safe call's
    # STARTED, an approval request, RUN_FINISHED and the next model request are barriers);
    # only a safe call may run before it is durable, as the effect model allows.
    run.emit(
        EventType.MODEL_TURN,
        text=response.text or "",
        tool_calls=proposals,
        usage={
            "input_tokens": response.usage.input_tokens,
            "output_tokens": response.usage.output_tokens,
        },
        cost_usd=cost,
        response_json=ModelMessagesTypeAdapter.dump_json([response]).decode(),
    )


def response_of(payload: Any) -> ModelResponse:
    """A recorded MODEL_TURN as the response the model gave."""
    if payload.response_json:
        (message,) = ModelMessagesTypeAdapter.validate_json(payload.response_json)
        assert isinstance(message, ModelResponse)
        return message
    # Written without the whole response (another writer, or v1): rebuilt from its facts.
    parts: list[Any] = [TextPart(payload.text)] if payload.text else []
    parts += [ToolCallPart(c.name, c.args_json, tool_call_id=c.call_id) for c in payload.tool_calls]
    return ModelResponse(parts=parts)


def _model_of(agent: Agent[Any, Any]) -> Model:
    model = agent.model
    if not isinstance(model, Model):
        raise TypeError("RunlogAgent needs an Agent constructed with a Model instance")
    return model


def fresh_context(agent: Agent[Any, Any], deps: Any, *, tool_name: str | None = None) -> Any:
    return RunContext(deps=deps, model=_model_of(agent), usage=RunUsage(), tool_name=tool_name)
