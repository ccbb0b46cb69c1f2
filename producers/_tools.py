"""Tools, the evidence a reconciler returns, and the decorator that declares both."""

from __future__ import annotations

import inspect
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from runlog.errors import InvalidToolDeclaration
from runlog.producers import _tracing as tracing
from runlog.producers._bounds import ResultSink
from runlog.producers._context import current_call
from runlog.schemas._keys import COMPENSATION_SUFFIX, compensated_tool, compensation_name

Risk = Literal["safe", "reversible", "irreversible"]
Receiver = Literal["fenced", "deadline", "dedupes_by_key"]
"""What a tool's receiver guarantees about a request that arrives late (a paused or
partitioned worker's, after recovery asked the lookup and retried):

- ``"fenced"``: it remembers the highest fencing token per key, refuses a request with a
  lower one, and its lookup, given the new owner's token, raises that floor first;
- ``"deadline"``: it refuses a request after the ``commit_deadline`` the request carries;
- ``"dedupes_by_key"``: a request repeated with a key it has seen makes no second effect.

Only these make a lookup's ``Absent`` final (docs/concepts/guarantees.md). A receiver
that gives more than one declares them all: ``receiver=("fenced", "deadline")``."""
RECEIVERS: tuple[Receiver, ...] = ("fenced", "deadline", "dedupes_by_key")
DEFAULT_COMMIT_WINDOW_S = 30.0
"""How long after its STARTED a request may commit, unless a tool declares its own."""
_FENCE = ("fencing_token", "commit_deadline")


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
    """The lookup found no effect with this key *now*.

    Whether the original request can still land later is the tool's declaration
    (``receiver=``), not the lookup's: recovery retries on it only when the receiver
    makes the absence final (see ``Receiver``); otherwise the call stays uncertain.
    """

    evidence: str = ""


@dataclass(frozen=True)
class Conflict:
    """An effect with this identity exists but its fields differ."""

    detail: str


@dataclass(frozen=True)
class Inconclusive:
    """The lookup could not tell (it timed out, its source was stale or down): no evidence
    either way, so the call stays uncertain. Evidence, not an error: return it, never raise
    it. (Named ``Unavailable`` before; ``runlog.Unavailable`` still works, with a warning.)"""

    reason: str


Evidence = Match | Absent | Conflict | Inconclusive
ToolFn = Callable[..., str | Awaitable[str]]
"""``fn(args, *, idempotency_key[, fencing_token][, commit_deadline]) -> str``, or an
``async def`` of it (``runlog.aio`` awaits it; the sync API runs it to completion). The
fence's arguments are passed only to a function that names them (or takes ``**kwargs``)."""
Reconciler = Callable[..., Evidence | Awaitable[Evidence]]
"""``reconcile(args, *, idempotency_key[, fencing_token]) -> Evidence``: the token is the
new owner's, so a fenced receiver raises its floor before it answers."""
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
    person about an uncertain call can say whether "retry with the same key" may repeat it.
    The same as ``receiver="dedupes_by_key"`` (either sets the other)."""

    receiver: Receiver | tuple[Receiver, ...] | None = None
    """What the receiver guarantees about a late request (``Receiver``, or several); None:
    nothing, so a lookup's ``Absent`` never allows a retry of a risky call."""

    commit_window_s: float = DEFAULT_COMMIT_WINDOW_S
    """Each request's ``commit_deadline`` is its STARTED's occurred-at plus this, so every
    reader of the log computes the deadline the receiver was sent. Lengthen it freely;
    never shorten it while calls started under the longer one may be open."""

    _takes: frozenset[str] = field(default=frozenset(), init=False, repr=False, compare=False)
    _lookup_takes: frozenset[str] = field(
        default=frozenset(), init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        _check_risk(self.name, self.risk, self.compensate)
        declared = _declared(self.receiver)
        if not declared <= set(RECEIVERS):
            raise InvalidToolDeclaration(
                f"tool {self.name}: receiver must name {RECEIVERS} or be None, "
                f"not {self.receiver!r}",
                tool=self.name,
                field="receiver",
                value=self.receiver,
            )
        window = self.commit_window_s
        if not (isinstance(window, int | float) and math.isfinite(window) and window > 0):
            raise InvalidToolDeclaration(
                f"tool {self.name}: commit_window_s must be positive, not {self.commit_window_s!r}",
                tool=self.name,
                field="commit_window_s",
                value=self.commit_window_s,
            )
        if self.dedupes_by_key and "dedupes_by_key" not in declared:
            declared |= {"dedupes_by_key"}
            receiver = tuple(r for r in RECEIVERS if r in declared)
            object.__setattr__(self, "receiver", receiver[0] if len(receiver) == 1 else receiver)
        object.__setattr__(self, "dedupes_by_key", "dedupes_by_key" in declared)
        object.__setattr__(self, "_takes", _fence_args(self.fn))
        object.__setattr__(self, "_lookup_takes", _fence_args(self.reconcile))

    @property
    def guarantees(self) -> frozenset[Any]:
        """The receiver's declared guarantees, as a set (``receiver`` may name one or more)."""
        return _declared(self.receiver)

    def __call__(
        self,
        args: dict[str, Any],
        *,
        idempotency_key: str,
        fencing_token: int | None = None,
        commit_deadline: datetime | None = None,
    ) -> str | Awaitable[str]:
        kw: dict[str, Any] = {}
        if self._takes:  # most tools take neither: nothing to build per call
            fence = {"fencing_token": fencing_token, "commit_deadline": commit_deadline}
            kw = {k: v for k, v in fence.items() if k in self._takes}
        if not tracing.enabled():
            return self.fn(args, idempotency_key=idempotency_key, **kw)
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
                "tool_call", attrs, self.fn(args, idempotency_key=idempotency_key, **kw)
            )
        with tracing.span("tool_call", **attrs):
            return self.fn(args, idempotency_key=idempotency_key, **kw)

    def lookup(
        self, args: dict[str, Any], *, idempotency_key: str, fencing_token: int
    ) -> Evidence | Awaitable[Evidence]:
        """Ask the reconciler, passing the new owner's ``fencing_token`` if it takes it."""
        assert self.reconcile is not None
        kw = {"fencing_token": fencing_token} if "fencing_token" in self._lookup_takes else {}
        return self.reconcile(args, idempotency_key=idempotency_key, **kw)

    def compensation(self) -> Tool | None:
        """The inverse as a tool of its own, so it is called, recorded and recovered like
        any call: ``<name>/compensate`` with arguments ``{"args": ..., "of": key}``.

        It is ``irreversible`` without a lookup: an inverse whose outcome was lost is
        asked of a person, never repeated blindly.
        """
        inverse = self.compensate
        if inverse is None:
            return None

        def undo(
            args: dict[str, Any], *, idempotency_key: str, **fence: Any
        ) -> str | Awaitable[str]:
            # ``fence`` holds only what the inverse names: its signature is undo's
            # (``__wrapped__``), so ``Tool`` passes nothing it would refuse.
            return inverse(
                args["args"], idempotency_key=idempotency_key, original_key=args["of"], **fence
            )

        undo.__wrapped__ = inverse  # type: ignore[attr-defined]  # async if the inverse is
        return Tool(name=compensation_name(self.name), fn=undo, risk="irreversible")


def _declared(receiver: Any) -> frozenset[Any]:
    """The guarantees ``receiver`` names (anything not a name or a tuple of names is one
    unknown guarantee, refused by ``Tool``)."""
    if receiver is None:
        return frozenset()
    if isinstance(receiver, tuple | list | set | frozenset):
        return frozenset(receiver)
    return frozenset((receiver,))


def _fence_args(fn: Any) -> frozenset[str]:
    """The fence's keyword arguments ``fn`` accepts, so a tool written before the fence
    (``fn(args, *, idempotency_key)``) is called exactly as before."""
    if fn is None:
        return frozenset()
    try:
        params = inspect.signature(fn).parameters.values()  # follows ``__wrapped__``
    except (TypeError, ValueError):  # a callable without an introspectable signature
        return frozenset()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return frozenset(_FENCE)
    positional = inspect.Parameter.POSITIONAL_ONLY
    return frozenset(p.name for p in params if p.name in _FENCE and p.kind is not positional)


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

    def lookup(
        args: dict[str, Any], *, idempotency_key: str, **fence: Any
    ) -> Evidence | Awaitable[Evidence]:
        # ``fence`` holds only what ``reconcile`` names (``Tool`` reads its signature
        # through ``__wrapped__``).
        if not tracing.enabled():
            return reconcile(args, idempotency_key=idempotency_key, **fence)
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
                "reconcile", attrs, reconcile(args, idempotency_key=idempotency_key, **fence), True
            )
        with tracing.span("reconcile", **attrs) as current:
            evidence = reconcile(args, idempotency_key=idempotency_key, **fence)
            tracing.annotate(current, evidence=type(evidence).__name__)
            return evidence

    lookup.__wrapped__ = reconcile  # type: ignore[attr-defined]  # async if reconcile is
    return lookup


def _check_risk(name: str, risk: object, compensate: object) -> None:
    """The risk a tool declares, and the inverse only a reversible tool may have."""
    if risk not in ("safe", "reversible", "irreversible"):
        raise InvalidToolDeclaration(
            f"tool {name}: risk must be safe, reversible or irreversible, not {risk!r}",
            tool=name,
            field="risk",
            value=risk,
        )
    if compensate is not None and risk != "reversible":
        raise InvalidToolDeclaration(
            f"tool {name}: only a reversible tool can declare compensate, not a {risk} one",
            tool=name,
            field="compensate",
            value=risk,
        )


def tool(
    name: str | None = None,
    *,
    risk: Risk = "safe",
    reconcile: Reconciler | None = None,
    on_large_result: ResultSink | None = None,
    compensate: Compensator | None = None,
    dedupes_by_key: bool = False,
    receiver: Receiver | tuple[Receiver, ...] | None = None,
    commit_window_s: float = DEFAULT_COMMIT_WINDOW_S,
) -> Callable[[ToolFn], Tool]:
    """Declare ``fn(args: dict, *, idempotency_key: str) -> str`` as a tool.

    ``fn`` may also take ``fencing_token: int`` (the run's epoch, monotonic across
    takeovers) and ``commit_deadline: datetime`` (UTC): send both to the receiver with the
    key. ``receiver`` declares what the receiver does with them (``Receiver``); a tool
    that declares nothing is never retried on ``Absent`` unless it is ``safe``.
    ``reconcile(args, *, idempotency_key[, fencing_token])`` returns ``Match``, ``Absent``,
    ``Conflict`` or ``Inconclusive`` from an authoritative lookup (the token is the new
    owner's); without it, recovery routes by ``risk``.
    A result over 256 KiB (UTF-8) is recorded cut, with its SHA-256 and length;
    ``on_large_result(idempotency_key, whole_result) -> reference`` keeps it elsewhere.
    ``compensate(args, *, idempotency_key, original_key)`` (``risk="reversible"`` only)
    undoes an effect recovery found unwanted (see docs/concepts/effects.md).
    ``dedupes_by_key=True`` (the same as ``receiver="dedupes_by_key"``) declares that the
    receiver deduplicates by the key it is sent (it will not repeat an effect that landed);
    the question a person answers about an uncertain call says what a retry does from it
    (docs/concepts/approvals.md). ``commit_window_s`` sets each request's deadline.
    """
    _check_risk(name or "(the function's name)", risk, compensate)  # refused at once

    def wrap(fn: ToolFn) -> Tool:
        tool_name = name or fn.__name__
        if compensated_tool(tool_name) is not None:
            raise InvalidToolDeclaration(
                f"tool {tool_name}: names ending in {COMPENSATION_SUFFIX!r} are runlog's",
                tool=tool_name,
                field="name",
                value=tool_name,
            )
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
            receiver=receiver,
            commit_window_s=commit_window_s,
        )

    return wrap
