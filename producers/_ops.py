"""The I/O a writer rule asks for, and the driver that performs it synchronously.

The rules of the tool-call path, recovery and approvals (``runlog.producers._calls``,
``runlog.producers._approvals``) are written once, as generators that *yield* what they
need done (append this event, invoke this tool, ask this reconciler, do this blocking
read) and receive the answer. ``drive`` performs each request in the caller's thread;
``runlog.producers._async_run`` performs the same requests with ``await``. Neither
driver decides anything, so the sync and the asyncio APIs cannot drift apart.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast

from runlog.producers._context import CallContext, call_context
from runlog.producers._tools import Evidence, Tool
from runlog.schemas._models import Event, Payload
from runlog.schemas._vocabulary import EventType

if TYPE_CHECKING:
    from runlog.producers._engine import Engine

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Append:
    """Append an event; ``durable`` waits for its acknowledgement and ownership (a
    barrier), else it is pipelined and the next barrier covers it."""

    event_type: EventType
    payload: Payload | dict[str, Any]
    durable: bool = True


@dataclass(frozen=True, slots=True)
class Invoke:
    """Call ``tool`` with ``args`` under ``ctx`` (what ``runlog.current_call()`` returns)."""

    tool: Tool
    args: dict[str, Any]
    ctx: CallContext

    def request(self) -> Any:
        """The call both drivers make: the key and the fence, as the tool's receiver needs."""
        return self.tool(
            self.args,
            idempotency_key=self.ctx.idempotency_key,
            fencing_token=self.ctx.fencing_token,
            commit_deadline=self.ctx.commit_deadline,
        )


@dataclass(frozen=True, slots=True)
class Lookup:
    """Ask ``tool``'s reconciler about the call ``ctx`` describes (``ctx.fencing_token``
    is the asking owner's, so a fenced receiver refuses the older requests first)."""

    tool: Tool
    args: dict[str, Any]
    ctx: CallContext

    def request(self) -> Any:
        return self.tool.lookup(
            self.args,
            idempotency_key=self.ctx.idempotency_key,
            fencing_token=self.ctx.fencing_token,
        )


@dataclass(frozen=True, slots=True)
class Blocking:
    """A blocking read or write (the log, Redis) that has no awaitable form: the async
    driver runs it in a worker thread, never in the event loop's."""

    fn: Callable[[], Any]


@dataclass(frozen=True, slots=True)
class Peek:
    """One Redis ``GET`` a step asks on the hot path (is a cancellation waiting?): the sync
    driver asks over its thread's connection, the async one awaits its loop's client."""

    key: str


Op = Append | Invoke | Lookup | Blocking | Peek
Steps = Generator[Op, Any, T]
"""A rule: yields the I/O it needs, returns its result."""


def append(
    event_type: EventType, payload: Payload | dict[str, Any] | None = None, /, **kw: Any
) -> Steps[Event]:
    """A durable append (a barrier) as a step."""
    ev = yield Append(event_type, payload if payload is not None else kw)
    return cast(Event, ev)


def emit(
    event_type: EventType, payload: Payload | dict[str, Any] | None = None, /, **kw: Any
) -> Steps[Event]:
    """A pipelined append as a step: no wait; a later barrier makes it durable."""
    ev = yield Append(event_type, payload if payload is not None else kw, durable=False)
    return cast(Event, ev)


def invoke(tool: Tool, args: dict[str, Any], ctx: CallContext) -> Steps[str]:
    out = yield Invoke(tool, args, ctx)
    return cast(str, out)


def lookup(tool: Tool, args: dict[str, Any], ctx: CallContext) -> Steps[Evidence]:
    out = yield Lookup(tool, args, ctx)
    return cast(Evidence, out)


def peek(key: str) -> Steps[bytes | None]:
    out = yield Peek(key)
    return cast("bytes | None", out)


def blocking(fn: Callable[[], T]) -> Steps[T]:
    out = yield Blocking(fn)
    return cast(T, out)


def _sync_await(value: Any, what: str) -> Any:
    """An async tool called from the sync API: run it to completion here."""
    if not inspect.isawaitable(value):
        return value
    try:
        asyncio.get_running_loop()
    except RuntimeError:

        async def wait() -> Any:
            return await value

        return asyncio.run(wait())
    close = getattr(value, "close", None)
    if callable(close):
        close()  # never started: no "was never awaited" warning
    raise TypeError(
        f"{what} is async and this thread runs an event loop: use runlog.aio, not the sync API"
    )


def perform(run: Engine, op: Op) -> Any:
    """Do ``op`` in this thread."""
    if isinstance(op, Append):
        if op.durable:
            return run.record(op.event_type, op.payload)
        return run.emit(op.event_type, op.payload)
    if isinstance(op, Invoke):
        with call_context(op.ctx):
            return _sync_await(op.request(), f"tool {op.tool.name}")
    if isinstance(op, Lookup):
        with call_context(op.ctx):
            return _sync_await(op.request(), f"the reconciler of {op.tool.name}")
    if isinstance(op, Peek):
        return run.deps.leases.peek(op.key)
    return op.fn()


def drive(run: Engine, steps: Steps[T]) -> T:
    """Run ``steps`` to its result, performing each request in this thread.

    An exception of a request is thrown back into the rule at the ``yield`` that asked
    for it, exactly as if the rule had made the call itself.
    """
    with run.lock:
        nxt = advance(steps)
        while not isinstance(nxt, Done):
            nxt = advance(steps, *outcome(perform, run, nxt))
        return nxt.value


@dataclass(frozen=True, slots=True)
class Done(Generic[T]):
    """A rule's result."""

    value: T


def advance(
    steps: Steps[T], answer: Any = None, error: BaseException | None = None
) -> Op | Done[T]:
    """The rule's next request once its last one gave ``answer`` (or raised ``error``,
    thrown into the rule at its ``yield``), or its result."""
    try:
        return steps.throw(error) if error is not None else steps.send(answer)
    except StopIteration as done:
        return Done(cast(T, done.value))


def outcome(fn: Callable[..., Any], *args: Any) -> tuple[Any, BaseException | None]:
    """``(fn(*args), None)``, or ``(None, what it raised)``: the rule decides what it means."""
    try:
        return fn(*args), None
    except BaseException as exc:  # noqa: BLE001 - handed to the rule, which re-raises
        return None, exc
