"""Tools, the evidence a reconciler returns, and the decorator that declares both."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from runlog.producers import tracing
from runlog.producers.context import current_call

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
ToolFn = Callable[..., str]
Reconciler = Callable[..., Evidence]


@dataclass(frozen=True)
class Tool:
    """A side-effecting function with its risk class and, optionally, its reconciler."""

    name: str
    fn: ToolFn
    risk: Risk = "safe"
    reconcile: Reconciler | None = None

    def __call__(self, args: dict[str, Any], *, idempotency_key: str) -> str:
        ctx = current_call()
        with tracing.span(
            "tool_call",
            tool=self.name,
            risk=self.risk,
            idempotency_key=idempotency_key,
            run_id=ctx.run_id if ctx else None,
            tenant=ctx.tenant if ctx else None,
            epoch=ctx.epoch if ctx else None,
            seq=ctx.started_seq if ctx else None,
            attempt=ctx.attempt if ctx else None,
        ):
            return self.fn(args, idempotency_key=idempotency_key)


def _traced(name: str, reconcile: Reconciler) -> Reconciler:
    """``reconcile`` inside a span: a lookup is a recovery step an operator wants to see."""

    def lookup(args: dict[str, Any], *, idempotency_key: str) -> Evidence:
        ctx = current_call()
        with tracing.span(
            "reconcile",
            tool=name,
            idempotency_key=idempotency_key,
            run_id=ctx.run_id if ctx else None,
            tenant=ctx.tenant if ctx else None,
            epoch=ctx.epoch if ctx else None,
            seq=ctx.started_seq if ctx else None,
        ) as current:
            evidence = reconcile(args, idempotency_key=idempotency_key)
            tracing.annotate(current, evidence=type(evidence).__name__)
            return evidence

    return lookup


def tool(
    name: str | None = None,
    *,
    risk: Risk = "safe",
    reconcile: Reconciler | None = None,
) -> Callable[[ToolFn], Tool]:
    """Declare ``fn(args: dict, *, idempotency_key: str) -> str`` as a tool.

    ``reconcile(args, *, idempotency_key)`` returns ``Match``, ``Absent``, ``Conflict`` or
    ``Unavailable`` from an authoritative lookup; without it, recovery routes by ``risk``.
    """
    if risk not in ("safe", "reversible", "irreversible"):
        raise ValueError(f"risk must be safe, reversible or irreversible, not {risk!r}")

    def wrap(fn: ToolFn) -> Tool:
        called = name or fn.__name__
        traced = None if reconcile is None or not tracing.enabled() else _traced(called, reconcile)
        return Tool(name=called, fn=fn, risk=risk, reconcile=traced or reconcile)

    return wrap
