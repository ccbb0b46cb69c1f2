"""Tools, the evidence a reconciler returns, and the decorator that declares both."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from runlog.producers.bounds import ResultSink

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
    on_large_result: ResultSink | None = None
    """Receives ``(idempotency_key, whole_result)`` when the result is too large to record
    whole; returns a reference (a URL, a blob key) that the completion records with the
    cut text, its SHA-256 and its length."""

    def __call__(self, args: dict[str, Any], *, idempotency_key: str) -> str:
        return self.fn(args, idempotency_key=idempotency_key)


def tool(
    name: str | None = None,
    *,
    risk: Risk = "safe",
    reconcile: Reconciler | None = None,
    on_large_result: ResultSink | None = None,
) -> Callable[[ToolFn], Tool]:
    """Declare ``fn(args: dict, *, idempotency_key: str) -> str`` as a tool.

    ``reconcile(args, *, idempotency_key)`` returns ``Match``, ``Absent``, ``Conflict`` or
    ``Unavailable`` from an authoritative lookup; without it, recovery routes by ``risk``.
    A result over 256 KiB (UTF-8) is recorded cut, with its SHA-256 and length;
    ``on_large_result(idempotency_key, whole_result) -> reference`` keeps it elsewhere.
    """
    if risk not in ("safe", "reversible", "irreversible"):
        raise ValueError(f"risk must be safe, reversible or irreversible, not {risk!r}")

    def wrap(fn: ToolFn) -> Tool:
        return Tool(
            name=name or fn.__name__,
            fn=fn,
            risk=risk,
            reconcile=reconcile,
            on_large_result=on_large_result,
        )

    return wrap
