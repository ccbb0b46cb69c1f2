"""What a tool may know about the call it is executing, without changing its signature.

``runlog.current_call()`` inside a tool (or its reconciler) returns the run, tenant, the
fencing token, idempotency key, attempt, STARTED seq and the commit deadline. The same
token and deadline are passed to a tool that names them as keyword arguments
(``fencing_token``, ``commit_deadline``): the context is for code deeper down that the
tool does not hand them to.
"""

from __future__ import annotations

from contextvars import ContextVar, Token
from dataclasses import dataclass
from datetime import datetime


@dataclass(frozen=True)
class CallContext:
    run_id: str
    tenant: str
    epoch: int
    """The writer's fencing token: the run's epoch when the call started (in a tool), or
    the new owner's epoch (in a reconciler that recovery asks)."""
    idempotency_key: str
    attempt: int
    started_seq: int
    commit_deadline: datetime | None = None
    """When the attempt's request stops being allowed to commit (UTC): its STARTED's
    occurred-at plus the tool's ``commit_window_s``. None in a reconciler."""

    @property
    def fencing_token(self) -> int:
        """The token a receiver orders requests by: remember the highest per key, refuse
        lower ones. Monotonic across takeovers (a new owner's epoch exceeds every earlier)."""
        return self.epoch


_current: ContextVar[CallContext | None] = ContextVar("runlog_call", default=None)


def current_call() -> CallContext | None:
    """The call being executed in this context, or None outside a tool invocation."""
    return _current.get()


class call_context:  # lower case: used as a function, ``with call_context(ctx):``
    """``ctx`` as ``current_call()`` for the block (a class, not ``@contextmanager``: it
    wraps every tool call, and a generator-based manager costs several times as much)."""

    __slots__ = ("_ctx", "_token")
    _token: Token[CallContext | None]

    def __init__(self, ctx: CallContext) -> None:
        self._ctx = ctx

    def __enter__(self) -> CallContext:
        self._token = _current.set(self._ctx)
        return self._ctx

    def __exit__(self, *exc: object) -> None:
        _current.reset(self._token)
