"""The sans-I/O rules' driver: a rule yields what it needs done, the driver does it.

``runlog.producers._ops``: ``drive`` performs each request in the caller's thread, sends its
answer back into the rule or throws its exception in at the ``yield`` that asked, and
returns the rule's result; an ``Invoke`` or ``Lookup`` runs under the call's context with
the key and the fence; ``advance`` and ``outcome`` are the steps the asyncio driver
(``runlog.producers._async_run``) is built from. The rules here are small ones of the
test's own, driven over a stand-in for the engine (its lock, appends and Redis peek).
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import pytest

import runlog
from runlog.producers import _ops as ops
from runlog.producers._context import CallContext, current_call
from runlog.producers._tools import Match
from runlog.schemas._vocabulary import EventType

DEADLINE = datetime(2030, 1, 1, tzinfo=UTC)
CTX = CallContext("run-1", "acme", 4, "k2_key", 1, 9, DEADLINE)


class Engine:
    """What ``drive`` and ``perform`` use of a run: its lock, its appends, its lease's peek."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.appended: list[tuple[str, EventType, Any]] = []
        self.peeked: list[str] = []
        self.deps = SimpleNamespace(leases=SimpleNamespace(peek=self._peek))

    def record(self, et: EventType, payload: Any) -> str:
        self.appended.append(("durable", et, payload))
        return f"event {len(self.appended)}"

    def emit(self, et: EventType, payload: Any) -> str:
        self.appended.append(("pipelined", et, payload))
        return f"event {len(self.appended)}"

    def _peek(self, key: str) -> bytes | None:
        self.peeked.append(key)
        return b"cancel" if key.endswith(":cancel") else None


def _drive(engine: Engine, steps: ops.Steps[Any]) -> Any:
    return ops.drive(engine, steps)  # type: ignore[arg-type]  # the stand-in


def test_drive_performs_each_request_and_returns_the_rules_result() -> None:
    def rule() -> ops.Steps[tuple[Any, ...]]:
        first = yield from ops.append(EventType.USER_MESSAGE, content="hi")
        second = yield from ops.emit(EventType.MEMORY_WRITTEN, {"key": "k", "value": "v"})
        flag = yield from ops.peek("run-1:cancel")
        none = yield from ops.peek("run-1:other")
        read = yield from ops.blocking(lambda: 41 + 1)
        return first, second, flag, none, read

    engine = Engine()
    assert _drive(engine, rule()) == ("event 1", "event 2", b"cancel", None, 42)
    assert engine.appended == [
        ("durable", EventType.USER_MESSAGE, {"content": "hi"}),
        ("pipelined", EventType.MEMORY_WRITTEN, {"key": "k", "value": "v"}),
    ]
    assert engine.peeked == ["run-1:cancel", "run-1:other"]


def test_a_requests_exception_is_thrown_into_the_rule_at_its_yield() -> None:
    def boom() -> None:
        raise ConnectionError("Redis went away")

    def careful() -> ops.Steps[str]:
        try:
            yield from ops.blocking(boom)
        except ConnectionError as exc:
            noted = yield from ops.append(EventType.USER_MESSAGE, content=f"noted: {exc}")
            return f"handled, then {noted}"
        return "not reached"

    engine = Engine()
    assert _drive(engine, careful()) == "handled, then event 1"
    assert engine.appended == [
        ("durable", EventType.USER_MESSAGE, {"content": "noted: Redis went away"})
    ]

    cleaned: list[str] = []

    def careless() -> ops.Steps[None]:
        try:
            yield from ops.blocking(boom)
        finally:
            cleaned.append("the rule saw it")

    with pytest.raises(ConnectionError, match="Redis went away"):
        _drive(engine, careless())
    assert cleaned == ["the rule saw it"]


def test_a_tool_and_its_lookup_run_under_the_calls_context_with_the_key_and_fence() -> None:
    seen: list[tuple[str, Any, Any, Any]] = []

    def pay(
        args: dict[str, Any], *, idempotency_key: str, fencing_token: int, commit_deadline: datetime
    ) -> str:
        seen.append(("pay", current_call(), (idempotency_key, fencing_token), commit_deadline))
        return f"paid {args['eur']}"

    def lookup(args: dict[str, Any], *, idempotency_key: str, fencing_token: int) -> Any:
        seen.append(("lookup", current_call(), (idempotency_key, fencing_token), None))
        return Match("paid 5")

    tool = runlog.tool("pay", risk="irreversible", reconcile=lookup)(pay)

    def rule() -> ops.Steps[tuple[str, Any]]:
        out = yield from ops.invoke(tool, {"eur": 5}, CTX)
        evidence = yield from ops.lookup(tool, {"eur": 5}, CTX)
        return out, evidence

    assert _drive(Engine(), rule()) == ("paid 5", Match("paid 5"))
    assert seen == [
        ("pay", CTX, ("k2_key", 4), DEADLINE),
        ("lookup", CTX, ("k2_key", 4), None),
    ]
    assert current_call() is None  # only for the call's duration


def test_an_async_tool_runs_to_completion_in_the_sync_driver_but_never_inside_a_loop() -> None:
    started: list[str] = []

    async def fetch(args: dict[str, Any], *, idempotency_key: str) -> str:
        started.append(idempotency_key)
        await asyncio.sleep(0)
        return f"fetched for {current_call().tenant if current_call() else None}"

    tool = runlog.tool("fetch")(fetch)
    assert _drive(Engine(), ops.invoke(tool, {}, CTX)) == "fetched for acme"
    assert started == ["k2_key"]

    made: list[Any] = []

    def fetch_later(args: dict[str, Any], *, idempotency_key: str) -> Any:
        made.append(fetch(args, idempotency_key=idempotency_key))  # the coroutine, unstarted
        return made[-1]

    fetch_later.__wrapped__ = fetch  # type: ignore[attr-defined]  # an async tool's wrapper
    wrapped = runlog.tool("fetch")(fetch_later)

    async def inside_a_loop() -> None:
        _drive(Engine(), ops.invoke(wrapped, {}, CTX))

    with pytest.raises(TypeError) as err:
        asyncio.run(inside_a_loop())
    assert "fetch" in str(err.value) and "runlog.aio" in str(err.value)
    assert started == ["k2_key"]  # the refused call never began ...
    # ... and was closed, so no "coroutine ... was never awaited" warning follows it.
    assert inspect.getcoroutinestate(made[0]) == inspect.CORO_CLOSED


def test_no_other_thread_takes_the_run_while_a_rule_is_driven() -> None:
    engine = Engine()
    others: list[bool] = []

    def try_from_another_thread() -> None:
        def attempt() -> None:
            got = engine.lock.acquire(blocking=False)
            others.append(got)
            if got:
                engine.lock.release()

        t = threading.Thread(target=attempt)
        t.start()
        t.join()

    def rule() -> ops.Steps[None]:
        yield from ops.blocking(try_from_another_thread)
        yield from ops.append(EventType.USER_MESSAGE, content="x")
        yield from ops.blocking(try_from_another_thread)

    _drive(engine, rule())
    try_from_another_thread()
    assert others == [False, False, True]  # held from the first step to the result


def test_advance_sends_answers_throws_errors_and_ends_with_the_result() -> None:
    """What the asyncio driver loops over: ``advance`` and ``outcome``."""

    def rule() -> ops.Steps[str]:
        a = yield from ops.peek("a")
        try:
            yield from ops.peek("b")
        except asyncio.CancelledError:
            return f"cancelled after {a!r}"
        return "not reached"

    steps = rule()
    assert ops.advance(steps) == ops.Peek("a")
    assert ops.advance(steps, b"A") == ops.Peek("b")

    def cancelled() -> None:
        raise asyncio.CancelledError  # a BaseException: still the rule's to decide

    answer, error = ops.outcome(cancelled)
    assert answer is None and isinstance(error, asyncio.CancelledError)
    assert ops.outcome(lambda x: x * 2, 21) == (42, None)
    assert ops.advance(steps, answer, error) == ops.Done("cancelled after b'A'")
