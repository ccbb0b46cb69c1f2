"""What a tool may know about the call it is executing, without changing its signature.

``runlog.current_call()`` inside a tool returns the run, tenant, writer epoch (the
fencing token), idempotency key, attempt and STARTED seq. A receiver that stores the
highest epoch it has seen per run can refuse a paused, fenced worker's late requests:
the lease orders the log, the token lets the receiver order the effects.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass


@dataclass(frozen=True)
class CallContext:
    run_id: str
    tenant: str
    epoch: int
    """The writer's fencing token when the call started."""
    idempotency_key: str
    attempt: int
    started_seq: int


_current: ContextVar[CallContext | None] = ContextVar("runlog_call", default=None)


def current_call() -> CallContext | None:
    """The call being executed in this context, or None outside a tool invocation."""
    return _current.get()


@contextmanager
def call_context(ctx: CallContext) -> Iterator[CallContext]:
    token = _current.set(ctx)
    try:
        yield ctx
    finally:
        _current.reset(token)
