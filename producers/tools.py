"""Tools, the evidence a reconciler returns, and the decorator that declares both."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

from runlog.producers import tracing
from runlog.producers.bounds import ResultSink
from runlog.producers.context import current_call
from runlog.schemas.keys import COMPENSATION_SUFFIX, compensated_tool, compensation_name

Risk = Literal["safe", "reversible", "irreversible"]


class ToolError(Exception):
    """Raised by a tool to report a *proven* failure: the effect did not happen.

    Any other exception from a tool is an uncertain outcome (the request may have been
    accepted), never a failure.
    """


@dataclass(frozen=True)
class Match:
    """The effect exists with the same semantic fields; ``result`` is what the tool returned."""

    result: str


@dataclass(frozen=True)
class Absent:
    """The effect provably does not exist and the original request can no longer commit."""

    evidence: str = ""


@dataclass(frozen=True)
class Conflict:
    """An effect with this identity exists but its fields differ."""

    detail: str


@dataclass(frozen=True)
class Unavailable:
    """The lookup could not answer (timeout, stale, down): no evidence either way."""

    reason: str


Evidence = Match | Absent | Conflict | Unavailable
ToolFn = Callable[..., str | Awaitable[str]]
"""``fn(args, *, idempotency_key) -> str``, or an ``async def`` of it (``runlog.aio``
awaits it; the sync API runs it to completion)."""
Reconciler = Callable[..., Evidence | Awaitable[Evidence]]
Compensator = Callable[..., str | Awaitable[str]]
"""``compensate(args, *, idempotency_key, original_key) -> str``: undo the effect the call
with ``original_key`` and ``args`` had. ``idempotency_key`` is the inverse's own key (send
it, so the receiver undoes once); ``runlog.ToolError`` is a proven failure of the inverse."""


@dataclass(frozen=True)
class Tool:
    """A side-effecting function with its risk class and, optionally, its reconciler."""

    name: str
    fn: ToolFn
    risk: Risk = "safe"
    reconcile: Reconciler | None = None
    on_large_result: ResultSink | None = None
    """Receives ``(idempotency_key, whole_result)`` when the result is too large to record
    whole; returns a reference (a URL, a blob key) that the completion records with the
    cut text, its SHA-256 and its length."""

    compensate: Compensator | None = None
    """The inverse of this tool's effect (reversible tools only), run by recovery when an
    unwanted effect is found: see ``compensation``."""

    dedupes_by_key: bool = False
    """The receiver deduplicates by the idempotency key: a request repeated with a key it
    has seen does not repeat the effect. Recorded on every STARTED, so the question put to a
    person about an uncertain call can say whether "retry with the same key" may repeat it."""

    def __call__(self, args: dict[str, Any], *, idempotency_key: str) -> str | Awaitable[str]:
        if not tracing.enabled():
            return self.fn(args, idempotency_key=idempotency_key)
        ctx = current_call()
        attrs: dict[str, tracing.Attr | None] = {
            "tool": self.name,
            "risk": self.risk,
            "idempotency_key": idempotency_key,
            "run_id": ctx.run_id if ctx else None,
            "tenant": ctx.tenant if ctx else None,
            "epoch": ctx.epoch if ctx else None,
            "seq": ctx.started_seq if ctx else None,
            "attempt": ctx.attempt if ctx else None,
        }
        if is_async(self.fn):
            return _awaited_in_span(
                "tool_call", attrs, self.fn(args, idempotency_key=idempotency_key)
            )
        with tracing.span("tool_call", **attrs):
            return self.fn(args, idempotency_key=idempotency_key)

    def compensation(self) -> Tool | None:
        """The inverse as a tool of its own, so it is called, recorded and recovered like
        any call: ``<name>/compensate`` with arguments ``{"args": ..., "of": key}``.

        It is ``irreversible`` without a lookup: an inverse whose outcome was lost is
        asked of a person, never repeated blindly.
        """
        inverse = self.compensate
        if inverse is None:
            return None

        def undo(args: dict[str, Any], *, idempotency_key: str) -> str | Awaitable[str]:
            return inverse(args["args"], idempotency_key=idempotency_key, original_key=args["of"])

        undo.__wrapped__ = inverse  # type: ignore[attr-defined]  # async if the inverse is
        return Tool(name=compensation_name(self.name), fn=undo, risk="irreversible")


def is_async(fn: Any) -> bool:
    """``fn`` (a tool, a tool's function, a reconciler, or a wrapper of one) is async."""
    while fn is not None:
        if inspect.iscoroutinefunction(fn):
            return True
        fn = getattr(fn, "fn", None) or getattr(fn, "__wrapped__", None)
    return False


async def _awaited_in_span(
    name: str, attrs: dict[str, tracing.Attr | None], pending: Any, evidence: bool = False
) -> Any:
    """An async tool's or reconciler's span covers its whole await, not its creation."""
    with tracing.span(name, **attrs) as current:
        out = await pending
        if evidence:
            tracing.annotate(current, evidence=type(out).__name__)
        return out


def _traced(name: str, reconcile: Reconciler) -> Reconciler:
    """``reconcile`` inside a span: a lookup is a recovery step an operator wants to see."""

    def lookup(args: dict[str, Any], *, idempotency_key: str) -> Evidence | Awaitable[Evidence]:
        if not tracing.enabled():
            return reconcile(args, idempotency_key=idempotency_key)
        ctx = current_call()
        attrs: dict[str, tracing.Attr | None] = {
            "tool": name,
            "idempotency_key": idempotency_key,
            "run_id": ctx.run_id if ctx else None,
            "tenant": ctx.tenant if ctx else None,
            "epoch": ctx.epoch if ctx else None,
            "seq": ctx.started_seq if ctx else None,
        }
        if is_async(reconcile):
            return _awaited_in_span(
                "reconcile", attrs, reconcile(args, idempotency_key=idempotency_key), True
            )
        with tracing.span("reconcile", **attrs) as current:
            evidence = reconcile(args, idempotency_key=idempotency_key)
            tracing.annotate(current, evidence=type(evidence).__name__)
            return evidence

    lookup.__wrapped__ = reconcile  # type: ignore[attr-defined]  # async if reconcile is
    return lookup


def tool(
    name: str | None = None,
    *,
    risk: Risk = "safe",
    reconcile: Reconciler | None = None,
    on_large_result: ResultSink | None = None,
    compensate: Compensator | None = None,
    dedupes_by_key: bool = False,
) -> Callable[[ToolFn], Tool]:
    """Declare ``fn(args: dict, *, idempotency_key: str) -> str`` as a tool.

    ``reconcile(args, *, idempotency_key)`` returns ``Match``, ``Absent``, ``Conflict`` or
    ``Unavailable`` from an authoritative lookup; without it, recovery routes by ``risk``.
    A result over 256 KiB (UTF-8) is recorded cut, with its SHA-256 and length;
    ``on_large_result(idempotency_key, whole_result) -> reference`` keeps it elsewhere.
    ``compensate(args, *, idempotency_key, original_key)`` (``risk="reversible"`` only)
    undoes an effect recovery found unwanted (see docs/concepts/effects.md).
    ``dedupes_by_key=True`` declares that the receiver deduplicates by the key it is sent
    (it will not repeat an effect that landed); the question a person answers about an
    uncertain call says what a retry does from it (docs/concepts/approvals.md).
    """
    if risk not in ("safe", "reversible", "irreversible"):
        raise ValueError(f"risk must be safe, reversible or irreversible, not {risk!r}")
    if compensate is not None and risk != "reversible":
        raise ValueError("only a reversible tool can declare compensate")

    def wrap(fn: ToolFn) -> Tool:
        tool_name = name or fn.__name__
        if compensated_tool(tool_name) is not None:
            raise ValueError(f"tool names ending in {COMPENSATION_SUFFIX!r} are runlog's")
        traced = None
        if reconcile is not None:  # spans only while a tracer provider is configured
            traced = _traced(tool_name, reconcile)
        return Tool(
            name=tool_name,
            fn=fn,
            risk=risk,
            reconcile=traced or reconcile,
            on_large_result=on_large_result,
            compensate=compensate,
            dedupes_by_key=dedupes_by_key,
        )

    return wrap
