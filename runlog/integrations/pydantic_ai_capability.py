"""Runlog durability as a Pydantic AI capability: ``Agent(capabilities=[RunlogDurability()])``.

The agent stays a normal ``Agent``: ``agent.run(prompt, run_id=...)``, ``run_sync``,
``run_stream`` and ``iter`` each open the runlog run named by Pydantic AI's ``run_id`` (a
fresh one when none is given; the same ``run_id`` resumes it after a crash), and the
capability's hooks do what ``RunlogAgent`` does around the agent's own loop:

* ``wrap_run``: ``open_run`` (lease, replay, recovery of uncertain calls before the model
  may act), the user prompt recorded as USER_MESSAGE, RUN_FINISHED once the agent produced
  its output (a ``DeferredToolRequests`` output leaves the run open).
* ``get_wrapper_model``: every request is answered from the run's n-th MODEL_TURN when the
  log holds one, else asked of the model and recorded before the agent uses it.
* ``get_wrapper_toolset``: every tool call goes through ``AsyncRun.call_tool`` (risk class,
  ``reconcile=``, the idempotency key in ``runlog.current_call()``).
* ``handle_deferred_tool_calls``: a tool with ``requires_approval=True`` (or raising
  ``ApprovalRequired``) becomes a runlog approval (kind ``action``, the call's key); without
  a decision the run raises ``runlog.Escalated`` and waits for ``runlog approve``/``reject``,
  and the next run with its ``run_id`` continues with the decision.

A fork (``runlog.fork``) goes on from its parent's conversation at the fork point with the
prompt (recorded before the model is asked) and ``model=`` it is run with; its turns are
numbered after the parent's and its keys scoped like its root's, so a call the parent made
is inherited, not made again (``RunlogAgent`` drives forks through this same code).

A streamed request (``run_stream``, ``iter`` streaming a node, ``event_stream_handler``) is
served from the whole response, recorded (or replayed) first, then streamed as its parts: a
streamed response never reaches the caller before the log holds it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from runlog.integrations._common import missing_extra

try:
    from pydantic_ai import DeferredToolRequests, DeferredToolResults, ToolDenied
    from pydantic_ai.capabilities.abstract import (
        AbstractCapability,
        CapabilityOrdering,
        WrapRunHandler,
    )
    from pydantic_ai.exceptions import ApprovalRequired, CallDeferred, ModelRetry
    from pydantic_ai.models import Model
    from pydantic_ai.run import AgentRunResult
    from pydantic_ai.tools import RunContext
    from pydantic_ai.toolsets import AbstractToolset
except ModuleNotFoundError as exc:
    raise missing_extra(exc, __name__, "pydantic-ai", ("pydantic_ai",)) from exc

from runlog import aio
from runlog._settings import Settings
from runlog.integrations._approvals import await_decision, rejection_note
from runlog.integrations._common import SUMMARY_CHARS, ToolPolicy, recorded_events
from runlog.integrations._pydantic_ai_parts import (
    DEFERRED_MARK,
    LIVE,
    Cost,
    Execution,
    ForkBase,
    RunlogModel,
    RunlogToolset,
    approval_for_part,
    default_cost,
    encode_result,
    fork_base,
    fresh_context,
    response_of,
)
from runlog.producers._tools import Tool, ToolError
from runlog.schemas._vocabulary import EventType

__all__ = ["RunlogDurability", "ToolPolicy"]


@dataclass
class _Open:
    run: aio.AsyncRun
    ex: Execution


class RunlogDurability(AbstractCapability[Any]):
    """Makes each run of the agent a runlog run: recorded, fenced, resumable after a crash.

    ``tools`` maps tool names to their ``ToolPolicy`` (a tool not named is ``safe``).
    ``takeover`` lets a run whose owner died be taken over without waiting for its lease.
    """

    def __init__(
        self,
        *,
        tools: Mapping[str, ToolPolicy] | None = None,
        tenant: str = "default",
        settings: Settings | None = None,
        name: str | None = None,
        takeover: bool = False,
        wait_s: float | None = None,
        approval_wait_s: float = 0.0,
        cost: Cost = default_cost,
    ) -> None:
        self.policies = dict(tools or {})
        self.tenant = tenant
        self.settings = settings
        self.name = name
        self.takeover = takeover
        self.wait_s = wait_s
        self.approval_wait_s = approval_wait_s
        self._cost = cost
        self._agent: Any = None
        self._open: _Open | None = None
        self._parent: RunlogDurability | None = None
        self._given: aio.AsyncRun | None = None
        self._events: list[Any] | None = None
        self.last_run: aio.AsyncRun | None = None
        self.replayed_turns = 0
        self.requested_turns = 0

    def get_ordering(self) -> CapabilityOrdering:
        # Innermost, like Pydantic AI's own durability capabilities: the agent's toolsets are
        # complete when it binds, and it wraps the model that actually serves each request.
        return CapabilityOrdering(position="innermost")

    def on(
        self, agent: Any, run: aio.AsyncRun | None = None, *, events: list[Any] | None = None
    ) -> RunlogDurability:
        """This capability bound to ``agent``; with ``run``, its runs use that open run (a
        fleet worker's, ``RunlogAgent.run_on``) instead of opening one (``events``: that
        run's valid events, when the caller already read them)."""
        bound = self._copy()
        bound._agent, bound._given, bound._parent = agent, run, self
        bound._events = events if run is not None else None
        return bound

    def for_agent(self, agent: Any) -> AbstractCapability[Any]:
        bound = self._copy()
        bound._agent = agent
        bound._parent = self
        return bound

    async def for_run(self, ctx: RunContext[Any]) -> AbstractCapability[Any]:
        # One instance per run (its run and turn counter), so runs of one agent may overlap;
        # what the last run did is reported on this one.
        run_copy = self._copy()
        run_copy._parent = self
        return run_copy

    def _copy(self) -> RunlogDurability:
        c = RunlogDurability(
            tools=self.policies,
            tenant=self.tenant,
            settings=self.settings,
            name=self.name,
            takeover=self.takeover,
            wait_s=self.wait_s,
            approval_wait_s=self.approval_wait_s,
            cost=self._cost,
        )
        c._agent = self._agent
        c._given = self._given
        c._events = self._events
        return c

    # The run ------------------------------------------------------------------------------
    async def wrap_run(
        self, ctx: RunContext[Any], *, handler: WrapRunHandler
    ) -> AgentRunResult[Any]:
        if self._given is not None:
            return await self._drive(self._given, ctx, handler)
        prompt = ctx.prompt if isinstance(ctx.prompt, str) else None
        async with aio.open_run(
            ctx.run_id,
            tenant=self.tenant,
            tools=await self.runlog_tools(ctx.deps),
            settings=self.settings,
            wait_s=self.wait_s,
            agent=self.name or getattr(self._agent, "name", None) or "pydantic-ai",
            goal=(prompt or "")[:SUMMARY_CHARS],
            takeover=self.takeover,
        ) as run:
            return await self._drive(run, ctx, handler)

    async def _drive(
        self, run: aio.AsyncRun, ctx: RunContext[Any], handler: WrapRunHandler
    ) -> AgentRunResult[Any]:
        """The agent's own loop on ``run``: the task recorded, turns replayed from the log,
        RUN_FINISHED once it produced its output (a ``DeferredToolRequests`` output leaves
        the run open).

        A fork (``runlog.fork``) goes on from its parent's conversation at the fork point:
        its turns are numbered after the parent's and its keys scoped like its root's, so
        a call the parent made is inherited, not made again. The agent's loop is either
        handed that conversation as its ``message_history`` (``RunlogAgent`` does, and may
        then give no prompt: the agent goes on with the parent's pending calls), or, given
        none, the model is shown it before the agent's own messages."""
        events = self._events if self._events is not None else await _own_events(run)
        recorded = [response_of(e.payload) for e in events if e.type is EventType.MODEL_TURN]
        prompt = ctx.prompt if isinstance(ctx.prompt, str) else None
        base: ForkBase | None = None
        if run.state.lineage is None:
            if not any(m.role == "user" for m in run.state.messages):
                if prompt is None:
                    raise ValueError(f"run {run.run_id} has no task yet: pass a text prompt")
                run.emit(EventType.USER_MESSAGE, content=prompt)  # durable before the model
        else:
            base = fork_base(events)
            _fork_prompt(run, base, prompt, history_given=bool(ctx.messages))
        ex = Execution(run, recorded, ctx.deps, base=base)
        if base is not None and not ctx.messages:
            ex.shown_before = list(base.history)
        self._open = _Open(run, ex)
        try:
            result = await handler()
        finally:
            self._open = None
            target: RunlogDurability | None = self
            while target is not None:  # this run's copy, the agent's, the caller's
                target.last_run = run
                target.replayed_turns = min(ex.next_turn, len(ex.recorded))
                target.requested_turns = ex.requested
                target = target._parent
        deferred = isinstance(result.output, DeferredToolRequests)
        if not deferred and run.state.status != "finished":
            await run.finish("succeeded", str(result.output)[:SUMMARY_CHARS])
        return result

    def get_wrapper_model(self, model: Model) -> Model | None:
        if self._open is None:
            return None
        return RunlogModel(model, self._open.ex, self._cost)

    def get_wrapper_toolset(self, toolset: AbstractToolset[Any]) -> AbstractToolset[Any] | None:
        return _LazyToolset(toolset, self)

    async def handle_deferred_tool_calls(
        self, ctx: RunContext[Any], *, requests: DeferredToolRequests
    ) -> DeferredToolResults | None:
        """Each call held back for approval as a runlog approval, answered by its decision.

        A call no one decided yet raises ``runlog.Escalated`` (after ``approval_wait_s``):
        the run stays open, waiting for ``runlog approve``/``reject``; the next run with its
        ``run_id`` replays to the same call, finds the decision by the call's key and goes
        on. Externally executed calls (``CallDeferred``) are left to the caller."""
        if self._open is None or not requests.approvals:
            return None
        ex = self._open.ex
        results = DeferredToolResults()
        for part in requests.approvals:
            approval = await await_decision(
                ex.run, await approval_for_part(ex, part), self.approval_wait_s
            )
            results.approvals[part.tool_call_id] = (
                True if approval.approved else ToolDenied(rejection_note(approval))
            )
        return results

    # What open_run needs ---------------------------------------------------------------
    async def runlog_tools(self, deps: Any = None) -> list[Tool]:
        """A runlog tool per tool of the agent: its risk class, reconciler and a function
        that runs the Pydantic AI tool (with the live call's context, or a fresh one when
        recovery retries a call before the agent runs)."""
        agent = self._agent
        if agent is None:
            raise RuntimeError("RunlogDurability used without an agent")
        ctx = fresh_context(agent, deps)
        out: list[Tool] = []
        for toolset in agent.toolsets:
            for name in await toolset.get_tools(ctx):
                policy = self.policies.get(name, ToolPolicy())
                fn = _invoker(name, toolset, deps, agent)
                out.append(policy.tool(name, fn))
        unknown = set(self.policies) - {t.name for t in out}
        if unknown:
            raise ValueError(f"policies for tools the agent does not have: {sorted(unknown)}")
        return out


async def _own_events(run: aio.AsyncRun) -> list[Any]:
    """The run's valid events (its own log: a fork's begins with RUN_FORKED), or none when
    there is nothing in them the agent replays (no turn yet, not a fork)."""
    if run.state.turns == 0 and run.state.lineage is None:
        return []
    return await recorded_events(run)


def _fork_prompt(
    run: aio.AsyncRun, base: ForkBase, prompt: str | None, *, history_given: bool
) -> None:
    """A fork's new prompt, recorded the first time (before the model is asked); a
    resumption passes it again, as for any run. Without one the agent goes on from the
    parent's conversation as it stood, which it can only do when its loop was handed that
    conversation (``history_given``)."""
    if base.prompt is not None:
        return
    if prompt is None:
        if history_given:
            return
        raise ValueError(
            f"fork {run.run_id}: pass the prompt it goes on with, or drive it with "
            "RunlogAgent (which goes on from the parent's conversation without one)"
        )
    if base.pending:
        names = ", ".join(p.tool_name for p in base.pending)
        raise ValueError(
            f"fork {run.run_id} ends in a model turn whose tool calls ({names}) have no "
            "result yet: fork at a later seq to give it a new prompt, or give none"
        )
    run.emit(EventType.USER_MESSAGE, content=prompt)  # durable before the model


class _LazyToolset(RunlogToolset[Any]):
    """``RunlogToolset`` over the run the capability has open when a tool is called."""

    def __init__(self, wrapped: AbstractToolset[Any], cap: RunlogDurability) -> None:
        super().__init__(wrapped, None)  # type: ignore[arg-type]
        self._cap = cap

    async def for_run(self, ctx: RunContext[Any]) -> AbstractToolset[Any]:
        inner = await self.wrapped.for_run(ctx)
        return self if inner is self.wrapped else _LazyToolset(inner, self._cap)

    @property
    def _execution(self) -> Execution:
        if self._cap._open is None:
            raise RuntimeError("a tool was called outside a runlog run")
        return self._cap._open.ex

    @_execution.setter
    def _execution(self, value: Any) -> None:
        pass


def _invoker(
    name: str, toolset: AbstractToolset[Any], deps: Any, agent: Any
) -> Callable[..., Awaitable[str]]:
    """Runs the tool with the live call's context and the agent's assembled toolset, or
    (recovery before the agent runs) the tool's own toolset with a fresh context."""

    async def invoke(args: dict[str, Any], *, idempotency_key: str) -> str:
        live = LIVE.get()
        if live is not None:
            target, ctx, tool = live.toolset, live.ctx, live.tool
        else:
            target = toolset
            ctx = fresh_context(agent, deps, tool_name=name)
            tool = (await toolset.get_tools(ctx))[name]
        try:
            value = await target.call_tool(name, args, ctx, tool)
        except (ApprovalRequired, CallDeferred) as exc:
            if live is not None:
                live.deferred = exc
            raise ToolError(f"{name}{DEFERRED_MARK}{type(exc).__name__}") from exc
        except ModelRetry as exc:
            if live is not None:
                live.retry = exc.message
            raise ToolError(exc.message) from exc
        return encode_result(value)

    return invoke
